# FGSM (PyTorch tutorials, beginner_source/fgsm_tutorial.py) used for adversarial training: the input made to
# require grad, the attack's own backward after model.zero_grad(), the perturbed input from data_grad.sign(), then
# the training step on the clean and the perturbed batch (Goodfellow et al.'s 0.5/0.5 mix).
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4), nn.LogSoftmax(dim=1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def fgsm_attack(image, epsilon, data_grad):
    sign_data_grad = data_grad.sign()
    perturbed_image = image + epsilon * sign_data_grad
    return torch.clamp(perturbed_image, 0, 1)


for step in range(5):
    data, target = torch.rand(8, 10), torch.randint(0, 4, (8,))
    data.requires_grad = True
    output = model(data)
    loss = F.nll_loss(output, target)
    model.zero_grad()
    loss.backward()
    data_grad = data.grad.data
    perturbed_data = fgsm_attack(data, 0.1, data_grad)
    optimizer.zero_grad()
    loss_clean = F.nll_loss(model(data.detach()), target)
    loss_adv = F.nll_loss(model(perturbed_data.detach()), target)
    loss = 0.5 * loss_clean + 0.5 * loss_adv
    loss.backward()
    optimizer.step()
    print(step, repr(loss.item()))
print([p.sum().item() for p in model.parameters()])
