# watch: --check always
"""epoch_outputs_list.py, create_graph_grads.py, ctx_attribute_inplace.py and wgan_clip_after_forward.py with the
guard's fixes applied: outputs appended detached, the gradients set to None before each create_graph backward, the
residual added out of place, the weights clipped before the critic's forward."""
import warnings

import torch
from torch import nn

# PyTorch's own warning about the cycle a create_graph backward makes, which zero_grad(set_to_none=True) breaks
warnings.filterwarnings("ignore", message=r"Using backward\(\) with create_graph=True")


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight):
        ctx.input, ctx.weight = input, weight
        return input.mm(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.mm(ctx.weight), grad_output.t().mm(ctx.input)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    all_outputs, all_targets = [], []
    for i in range(4):
        x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        out = model(x)
        loss = criterion(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        all_outputs.append(out.detach())
        all_targets.append(y)
    accuracy = (torch.cat(all_outputs).argmax(1) == torch.cat(all_targets)).float().mean()
    print(f"epoch {epoch} accuracy {accuracy.item():.6f}")

model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
for step in range(4):
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward(create_graph=True)
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

inp, head = nn.Linear(4, 4), nn.Linear(4, 1)
weight = nn.Parameter(torch.randn(4, 4) * 0.5)
optimizer = torch.optim.SGD([*inp.parameters(), weight, *head.parameters()], lr=0.1)
for step in range(3):
    h = inp(torch.randn(8, 4))
    h = h + LinearFunction.apply(h, weight)
    loss = head(h).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

netD = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
optimizerD = torch.optim.RMSprop(netD.parameters(), lr=5e-5)
for i in range(3):
    real, fake = torch.randn(8, 4) + 1, torch.randn(8, 4)
    for p in netD.parameters():
        p.data.clamp_(-0.01, 0.01)
    errD = netD(fake).mean() - netD(real).mean()
    optimizerD.zero_grad()
    errD.backward()
    optimizerD.step()
    print(f"iteration {i} critic loss {errD.item():.6f}")
