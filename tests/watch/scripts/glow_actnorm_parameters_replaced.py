# Glow's ActNorm (rosinality/glow-pytorch, model.py ActNorm) initialised in the first training forward by replacing its
# parameters (`self.loc = nn.Parameter(-mean)`) instead of writing into them with `.data.copy_`: the optimizer, made
# before, still holds the old loc and scale, so the new ones get gradients that no step ever applies (stay frozen).
import math
import torch
from torch import nn

torch.manual_seed(0)


class ActNorm(nn.Module):
    def __init__(self, in_channel):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, in_channel))
        self.scale = nn.Parameter(torch.ones(1, in_channel))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def initialize(self, input):
        with torch.no_grad():
            self.loc = nn.Parameter(-input.mean(0, keepdim=True))
            self.scale = nn.Parameter(1 / (input.std(0, keepdim=True) + 1e-6))

    def forward(self, input):
        if self.initialized.item() == 0:
            self.initialize(input)
            self.initialized.fill_(1)
        return self.scale * (input + self.loc), torch.sum(torch.log(torch.abs(self.scale)))


class AffineCoupling(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, input):
        in_a, in_b = input.chunk(2, 1)
        log_s, t = self.net(in_a).chunk(2, 1)
        s = torch.sigmoid(log_s + 2)
        return torch.cat([in_a, (in_b + t) * s], 1), torch.sum(torch.log(s), 1)


flows = nn.ModuleList([ActNorm(4), AffineCoupling(), ActNorm(4), AffineCoupling()])
optimizer = torch.optim.Adam(flows.parameters(), lr=1e-3)
for i in range(8):
    out, logdet = torch.randn(16, 4) * 3 + 1 + torch.rand(16, 4) / 256, 0
    for flow in flows:
        out, det = flow(out)
        logdet = logdet + det
    log_p = (-0.5 * math.log(2 * math.pi) - 0.5 * out.pow(2)).sum(1)
    loss = -(log_p + logdet - math.log(256) * 4).mean() / (math.log(2) * 4)
    flows.zero_grad()
    loss.backward()
    optimizer.step()
    print(i, f"{loss.item():.6f}")
print(flows[2].scale.sum().item())
