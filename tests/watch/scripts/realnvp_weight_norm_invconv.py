# Real NVP / Glow coupling layers (chrischute/real-nvp, models/real_nvp/coupling_layer.py and util/nn_util.py
# WNConv2d, with torch.nn.utils.parametrizations.weight_norm in place of the deprecated nn.utils.weight_norm;
# rosinality/glow-pytorch, model.py InvConv2dLU: the weight rebuilt every forward from w_p, w_l, w_s, w_u and the
# mask buffers), trained on the negative log-likelihood (RealNVPLoss), gradients clipped (util.clip_grad_norm).
import math
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

torch.manual_seed(0)


class InvConvLU(nn.Module):
    def __init__(self, n):
        super().__init__()
        q, _ = torch.linalg.qr(torch.randn(n, n))
        w_p, w_l, w_u = torch.linalg.lu(q)
        w_s = torch.diag(w_u)
        self.register_buffer("w_p", w_p)
        self.register_buffer("u_mask", torch.triu(torch.ones(n, n), 1))
        self.register_buffer("l_mask", self.u_mask.T.clone())
        self.register_buffer("s_sign", torch.sign(w_s))
        self.register_buffer("l_eye", torch.eye(n))
        self.w_l, self.w_s, self.w_u = nn.Parameter(w_l), nn.Parameter(torch.log(torch.abs(w_s))), nn.Parameter(w_u)

    def forward(self, x):
        weight = self.w_p @ (self.w_l * self.l_mask + self.l_eye) @ (
            self.w_u * self.u_mask + torch.diag(self.s_sign * torch.exp(self.w_s)))
        return x @ weight.T, torch.sum(self.w_s)


class Coupling(nn.Module):
    def __init__(self):
        super().__init__()
        self.st = nn.Sequential(weight_norm(nn.Linear(2, 16)), nn.ReLU(), weight_norm(nn.Linear(16, 4)))
        self.rescale = nn.Parameter(torch.ones(1, 2))

    def forward(self, x):
        x_id, x_change = x.chunk(2, 1)
        s, t = self.st(x_id).chunk(2, 1)
        s = self.rescale * torch.tanh(s)
        return torch.cat([x_id, (x_change + t) * s.exp()], 1), s.sum(1)


flows = nn.ModuleList([InvConvLU(4), Coupling(), InvConvLU(4), Coupling()])
optimizer = torch.optim.Adam(flows.parameters(), lr=1e-3)
for step in range(8):
    z, sldj = torch.randn(16, 4) * 2 + 1, torch.zeros(16)
    for flow in flows:
        z, ldj = flow(z)
        sldj = sldj + ldj
    prior_ll = (-0.5 * (z ** 2 + math.log(2 * math.pi))).sum(1)
    loss = -(prior_ll + sldj).mean()
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(flows.parameters(), 100.)
    optimizer.step()
    print(step, f"{loss.item():.6f}")
print(flows[1].st[0].parametrizations.weight.original0.sum().item())
