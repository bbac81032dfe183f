# The forums' get_activation recipe, without .detach(): a forward hook keeps a hidden layer's output in a global dict,
# and the loss penalizes it. Correct: the dict's entry is this step's (the hook sets it during the forward), though
# older than every graph the loop's own variables hold and in a dict the loop never adds to.
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
activation = {}


def get_activation(name):
    def hook(model, input, output):
        activation[name] = output
    return hook


model[1].register_forward_hook(get_activation('hidden'))
for step in range(3):
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    out = model(x)
    loss = (out - y).pow(2).mean() + 0.01 * activation['hidden'].pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"{loss.item():.6f}")
print(f"{model[0].weight.sum().item():.8f}")
