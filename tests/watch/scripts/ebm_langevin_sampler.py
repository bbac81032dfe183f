# An energy-based model trained by contrastive divergence as the UvA deep learning course's tutorial 8 writes it
# (phlippe/uvadlc_notebooks, Sampler.generate_samples): a replay buffer of past samples, Langevin steps that
# back-propagate the energy of the samples with every parameter frozen (`p.requires_grad = False`) and read
# `inp_imgs.grad`, the result detached into the buffer. Correct: that backward trains nothing on purpose.
import random

import torch
from torch import nn

random.seed(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 32), nn.SiLU(), nn.Linear(32, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.0, 0.999))
examples = [torch.rand(1, 4) * 2 - 1 for _ in range(16)]


def generate_samples(steps=4, step_size=0.1):
    n_new = sum(random.random() < 0.05 for _ in range(8))
    inp_imgs = torch.cat([torch.rand(n_new, 4) * 2 - 1, *random.choices(examples, k=8 - n_new)], dim=0).detach()
    inp_imgs.requires_grad = True
    for p in model.parameters():
        p.requires_grad = False
    model.eval()
    for _ in range(steps):
        inp_imgs.data.add_(torch.randn_like(inp_imgs) * 0.005).clamp_(min=-1.0, max=1.0)
        out_imgs = -model(inp_imgs)
        out_imgs.sum().backward()
        inp_imgs.grad.data.clamp_(-0.03, 0.03)
        inp_imgs.data.add_(-step_size * inp_imgs.grad.data)
        inp_imgs.grad.detach_()
        inp_imgs.grad.zero_()
        inp_imgs.data.clamp_(min=-1.0, max=1.0)
    for p in model.parameters():
        p.requires_grad = True
    model.train()
    examples[:0] = list(inp_imgs.detach().split(1))
    del examples[64:]
    return inp_imgs.detach()


for step in range(8):
    real_imgs = torch.randn(8, 4) * 0.3
    fake_imgs = generate_samples()
    real_out, fake_out = (-model(torch.cat([real_imgs, fake_imgs], dim=0))).chunk(2, dim=0)
    loss = 0.1 * (real_out ** 2 + fake_out ** 2).mean() + fake_out.mean() - real_out.mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, f"{loss.item():.6f}")
