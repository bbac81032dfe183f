# Trimmed from christiancosgrove/pytorch-spectral-normalization-gan, spectral_normalization.py (a SpectralNorm
# wrapper whose forward writes u, v through .data and sets the module's `weight` attribute to w / sigma, a tensor
# with a graph kept on the module between steps) and main.py (hinge loss, disc_iters=2, D on G(z).detach());
# torch.nn.utils.spectral_norm (old, hook-based: the same attribute made again before each forward) in G. Correct.
import torch
from torch import nn
from torch.nn import Parameter


def l2normalize(v, eps=1e-12):
    return v / (v.norm() + eps)


class SpectralNorm(nn.Module):
    def __init__(self, module, name="weight", power_iterations=1):
        super().__init__()
        self.module, self.name, self.power_iterations = module, name, power_iterations
        w = getattr(self.module, self.name)
        height, width = w.data.shape[0], w.view(w.data.shape[0], -1).data.shape[1]
        u = Parameter(w.data.new(height).normal_(0, 1), requires_grad=False)
        v = Parameter(w.data.new(width).normal_(0, 1), requires_grad=False)
        u.data, v.data = l2normalize(u.data), l2normalize(v.data)
        w_bar = Parameter(w.data)
        del self.module._parameters[self.name]
        self.module.register_parameter(self.name + "_u", u)
        self.module.register_parameter(self.name + "_v", v)
        self.module.register_parameter(self.name + "_bar", w_bar)

    def _update_u_v(self):
        u, v = getattr(self.module, self.name + "_u"), getattr(self.module, self.name + "_v")
        w = getattr(self.module, self.name + "_bar")
        height = w.data.shape[0]
        for _ in range(self.power_iterations):
            v.data = l2normalize(torch.mv(torch.t(w.view(height, -1).data), u.data))
            u.data = l2normalize(torch.mv(w.view(height, -1).data, v.data))
        sigma = u.dot(w.view(height, -1).mv(v))
        setattr(self.module, self.name, w / sigma.expand_as(w))

    def forward(self, *args):
        self._update_u_v()
        return self.module.forward(*args)


torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.utils.spectral_norm(nn.Linear(16, 6)), nn.Tanh())
discriminator = nn.Sequential(SpectralNorm(nn.Linear(6, 16)), nn.LeakyReLU(0.1), SpectralNorm(nn.Linear(16, 1)))
optim_disc = torch.optim.Adam(filter(lambda p: p.requires_grad, discriminator.parameters()), lr=2e-3, betas=(0., .9))
optim_gen = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.0, 0.9))
for batch_idx in range(4):
    data = torch.randn(8, 6) * 0.5 + 1
    for _ in range(2):  # disc_iters
        z = torch.randn(8, 4)
        optim_disc.zero_grad()
        optim_gen.zero_grad()
        disc_loss = nn.ReLU()(1.0 - discriminator(data)).mean() + \
            nn.ReLU()(1.0 + discriminator(generator(z).detach())).mean()
        disc_loss.backward()
        optim_disc.step()
    z = torch.randn(8, 4)
    optim_disc.zero_grad()
    optim_gen.zero_grad()
    gen_loss = -discriminator(generator(z)).mean()
    gen_loss.backward()
    optim_gen.step()
    print(f"step {batch_idx} disc {disc_loss.item():.6f} gen {gen_loss.item():.6f}")
print(discriminator[0].module.weight_u[:3].tolist(), generator[2].weight_orig.sum().item())
