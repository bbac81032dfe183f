# StyleGAN2-ADA's path-length regularization (NVlabs/stylegan2-ada-pytorch, training/loss.py, phase 'Greg') with the
# running mean written back without `.detach()`: `self.pl_mean.copy_(pl_mean)` gives the loss object's plain tensor
# the graph of the penalty, which the next regularization goes back through after that backward freed it.
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


class StyleGAN2Loss:
    def __init__(self, G_mapping, G_synthesis, D, pl_decay=0.01, pl_weight=2):
        self.G_mapping, self.G_synthesis, self.D = G_mapping, G_synthesis, D
        self.pl_decay, self.pl_weight, self.pl_mean = pl_decay, pl_weight, torch.zeros([])

    def accumulate_gradients(self, phase, real_img, gen_z):
        if phase == "Gmain":
            loss_Gmain = F.softplus(-self.D(self.G_synthesis(self.G_mapping(gen_z))))
            loss_Gmain.mean().backward()
        if phase == "Greg":
            gen_ws = self.G_mapping(gen_z[:2])
            gen_img = self.G_synthesis(gen_ws)
            pl_noise = torch.randn_like(gen_img) / 2
            pl_grads = torch.autograd.grad(outputs=[(gen_img * pl_noise).sum()], inputs=[gen_ws], create_graph=True,
                                           only_inputs=True)[0]
            pl_lengths = pl_grads.square().sum(1).sqrt()
            pl_mean = self.pl_mean.lerp(pl_lengths.mean(), self.pl_decay)
            self.pl_mean.copy_(pl_mean)
            loss_Gpl = (pl_lengths - pl_mean).square() * self.pl_weight
            (gen_img[:, 0] * 0 + loss_Gpl).mean().mul(4).backward()
        if phase == "Dmain":
            gen_img = self.G_synthesis(self.G_mapping(gen_z)).detach()
            loss = F.softplus(self.D(gen_img)) + F.softplus(-self.D(real_img))
            loss.mean().backward()


G_mapping, G_synthesis = nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(0.2)), nn.Linear(4, 6)
D = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
G_opt = torch.optim.Adam([*G_mapping.parameters(), *G_synthesis.parameters()], lr=2e-3)
D_opt = torch.optim.Adam(D.parameters(), lr=2e-3)
loss = StyleGAN2Loss(G_mapping, G_synthesis, D)
phases = [("Gmain", G_opt, [G_mapping, G_synthesis], 1), ("Greg", G_opt, [G_mapping, G_synthesis], 4),
          ("Dmain", D_opt, [D], 1)]
for batch_idx in range(8):
    real_img, gen_z = torch.randn(8, 6) + 1, torch.randn(8, 4)
    for name, opt, modules, interval in phases:
        if batch_idx % interval != 0:
            continue
        opt.zero_grad(set_to_none=True)
        for module in modules:
            module.requires_grad_(True)
        loss.accumulate_gradients(name, real_img, gen_z)
        for module in modules:
            module.requires_grad_(False)
        opt.step()
    print(batch_idx, f"{loss.pl_mean.item():.6f} {G_synthesis.weight.sum().item():.6f}")
