# tiny NeRF (bmild/nerf, tiny_nerf.ipynb, as ported to PyTorch): the rays of one training pose, stratified samples
# along each ray, a positional encoding, an MLP for (rgb, sigma), alpha compositing with an exclusive cumprod of the
# transmittance (written in place: `cumprod[..., 0] = 1.0`), an MSE to the target image.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
H = W = 4
focal, N_samples, L_embed = 5.0, 8, 3


def posenc(x):
    rets = [x]
    for i in range(L_embed):
        for fn in [torch.sin, torch.cos]:
            rets.append(fn(2.0 ** i * x))
    return torch.cat(rets, -1)


def get_rays(H, W, focal, c2w):
    i, j = torch.meshgrid(torch.arange(W, dtype=torch.float32), torch.arange(H, dtype=torch.float32), indexing="xy")
    dirs = torch.stack([(i - W * 0.5) / focal, -(j - H * 0.5) / focal, -torch.ones_like(i)], -1)
    rays_d = torch.sum(dirs[..., None, :] * c2w[:3, :3], -1)
    rays_o = c2w[:3, -1].expand(rays_d.shape)
    return rays_o, rays_d


def cumprod_exclusive(tensor):
    cumprod = torch.cumprod(tensor, -1)
    cumprod = torch.roll(cumprod, 1, -1)
    cumprod[..., 0] = 1.0
    return cumprod


def render_rays(network_fn, rays_o, rays_d, near, far, N_samples, rand=False):
    z_vals = torch.linspace(near, far, N_samples)
    if rand:
        z_vals = z_vals + torch.rand(list(rays_o.shape[:-1]) + [N_samples]) * (far - near) / N_samples
    pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]
    raw = network_fn(posenc(pts.reshape(-1, 3))).reshape(list(pts.shape[:-1]) + [4])
    sigma_a = F.relu(raw[..., 3])
    rgb = torch.sigmoid(raw[..., :3])
    dists = torch.cat([z_vals[..., 1:] - z_vals[..., :-1], torch.full(z_vals[..., :1].shape, 1e10)], -1)
    alpha = 1.0 - torch.exp(-sigma_a * dists)
    weights = alpha * cumprod_exclusive(1.0 - alpha + 1e-10)
    rgb_map = torch.sum(weights[..., None] * rgb, -2)
    depth_map = torch.sum(weights * z_vals, -1)
    acc_map = torch.sum(weights, -1)
    return rgb_map, depth_map, acc_map


model = nn.Sequential(nn.Linear(3 + 3 * 2 * L_embed, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
images, poses = torch.rand(3, H, W, 3), torch.eye(4).repeat(3, 1, 1) + 0.1 * torch.randn(3, 4, 4)
for i in range(4):
    img_i = torch.randint(0, images.shape[0], ()).item()
    target, pose = images[img_i], poses[img_i]
    rays_o, rays_d = get_rays(H, W, focal, pose)
    rgb, depth, acc = render_rays(model, rays_o, rays_d, near=2.0, far=6.0, N_samples=N_samples, rand=True)
    loss = torch.mean((rgb - target) ** 2)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(i, repr(loss.item()), repr(-10.0 * torch.log10(loss).item()))
print([p.sum().item() for p in model.parameters()])
