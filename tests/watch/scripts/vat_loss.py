# virtual adversarial training (lyakaap/VAT-pytorch, vat.py): the prediction on the clean input is the target (made
# under no_grad), a random direction d is refined by one power iteration through torch.autograd.grad, then the
# adversarial KL is added to the supervised loss.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def l2_normalize(d):
    return d / (d.flatten(1).norm(dim=1).view(-1, 1) + 1e-8)


def vat_loss(x, xi=10.0, eps=1.0):
    with torch.no_grad():
        pred = F.softmax(model(x), dim=1)
    d = l2_normalize(torch.rand(x.shape).sub(0.5))
    d.requires_grad_()
    pred_hat = model(x + xi * d)
    adv_distance = F.kl_div(F.log_softmax(pred_hat, dim=1), pred, reduction="batchmean")
    adv_distance.backward()
    d = l2_normalize(d.grad)
    model.zero_grad()
    r_adv = d * eps
    pred_hat = model(x + r_adv)
    return F.kl_div(F.log_softmax(pred_hat, dim=1), pred, reduction="batchmean")


for step in range(5):
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    opt.zero_grad()
    lds = vat_loss(x)
    loss = F.cross_entropy(model(x), y) + 1.0 * lds
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item()!r}")
print([p.sum().item() for p in model.parameters()])
