# Deep image prior's denoising as DmitryUlyanov/deep-image-prior's denoising.ipynb writes it, with
# utils/common_utils.py's optimize('adam', ...): a network fitted to one noisy image from a fixed noise input, the input
# perturbed at every step (`net_input = net_input_saved + (noise.normal_() * reg_noise_std)`, `noise` refilled in
# place), an exponential average of the outputs kept across steps as a constant (`out.detach()`), the closure
# back-propagating itself and the loop calling `optimizer.step()` after it.
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(8, 3, 3, padding=1), nn.Sigmoid())
mse = torch.nn.MSELoss()
img_noisy_torch = torch.rand(1, 3, 8, 8)
net_input = (torch.rand(1, 4, 8, 8) * 0.1).detach()
reg_noise_std, exp_weight, LR, num_iter = 1. / 30., 0.99, 0.01, 6

net_input_saved = net_input.detach().clone()
noise = net_input.detach().clone()
out_avg = None
i = 0


def closure():
    global i, out_avg, net_input
    if reg_noise_std > 0:
        net_input = net_input_saved + (noise.normal_() * reg_noise_std)
    out = net(net_input)
    # Smoothing
    if out_avg is None:
        out_avg = out.detach()
    else:
        out_avg = out_avg * exp_weight + out.detach() * (1 - exp_weight)
    total_loss = mse(out, img_noisy_torch)
    total_loss.backward()
    print(f"{i} {total_loss.item():.8f} {mse(out_avg, img_noisy_torch).item():.8f}")
    i += 1
    return total_loss


def optimize(parameters, closure, LR, num_iter):
    optimizer = torch.optim.Adam(parameters, lr=LR)
    for j in range(num_iter):
        optimizer.zero_grad()
        closure()
        optimizer.step()


p = [x for x in net.parameters()]
optimize(p, closure, LR, num_iter)
print(f"{sum(p.double().sum().item() for p in net.parameters()):.12f}")
