# Growing neural cellular automata's sample pool (greydanus/studying_growth, main.py; the correct loop:
# nca_sample_pool) with the batch's final states written back into the pool without `.detach()`, after the optimizer
# step: the next batch drawn from the pool goes through the last batch's graph, which its backward freed. The pool is
# what carries it, not `final_states`, which the loop sets anew before reading it.
import numpy as np
import torch
import torch.nn as nn
from torch.optim.lr_scheduler import MultiStepLR


def make_circle_masks(n, h, w):
    x = np.linspace(-1.0, 1.0, w)[None, None, :]
    y = np.linspace(-1.0, 1.0, h)[None, :, None]
    center = np.random.random([2, n, 1, 1]) * 1.0 - 0.5
    r = np.random.random([n, 1, 1]) * 0.3 + 0.1
    x, y = (x - center[0]) / r, (y - center[1]) / r
    return torch.tensor(1 - (x * x + y * y < 1.0).astype(np.float32))


class CA(nn.Module):
    def __init__(self, state_dim=16, hidden_dim=128, dropout=0):
        super(CA, self).__init__()
        self.state_dim = state_dim
        self.dropout = dropout
        self.update = nn.Sequential(
            nn.Conv2d(state_dim, 3 * state_dim, 3, padding=1, groups=state_dim, bias=False),  # perceive
            nn.Conv2d(3 * state_dim, hidden_dim, 1), nn.ReLU(), nn.Conv2d(hidden_dim, state_dim, 1))
        self.update[-1].weight.data *= 0  # initial residual updates should be close to zero
        identity = np.outer([0, 1, 0], [0, 1, 0])
        dx = np.outer([1, 2, 1], [-1, 0, 1]) / 8.0
        kernel = np.tile(np.stack([identity, dx, dx.T], axis=0), [state_dim, 1, 1])
        self.update[0].weight.data[...] = torch.Tensor(kernel)[:, None, :, :]
        self.update[0].weight.requires_grad = False

    def forward(self, x, num_steps, seed_loc=None):
        alive_mask = lambda alpha: nn.functional.max_pool2d(alpha, 3, stride=1, padding=1) > 0.1  # noqa: E731
        frames = []
        for i in range(num_steps):
            alive_mask_pre = alive_mask(alpha=x[:, 3:4])
            update_mask = torch.rand(*x.shape, device=x.device) > self.dropout
            x = x + update_mask * self.update(x)
            x = x * alive_mask_pre * alive_mask(alpha=x[:, 3:4])
            if seed_loc is not None:
                x[..., 3, seed_loc[0], seed_loc[1]] = 1.  # this keeps the original seed from dying
            frames.append(x)
        return torch.stack(frames)


def normalize_grads(model):
    for p in model.parameters():
        p.grad = p.grad / (p.grad.norm() + 1e-8) if p.grad is not None else p.grad


torch.manual_seed(0)
np.random.seed(0)
state_dim, batch_size, pool_size, perturb_n, seed_loc = 8, 4, 16, 1, (5, 5)
model = CA(state_dim=state_dim, hidden_dim=16, dropout=0.5)
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3, weight_decay=0)
scheduler = MultiStepLR(optimizer, milestones=[4], gamma=0.5)
target_rgba = torch.rand(1, 4, 10, 10)
init_state = torch.zeros(batch_size, state_dim, 10, 10)
init_state[..., 3:, seed_loc[0], seed_loc[1]] = 1
pool = init_state[:1].repeat(pool_size, 1, 1, 1).cpu()
for step in range(8):
    pool_ixs = np.random.choice(pool_size, batch_size, False)
    input_states = pool[pool_ixs]
    perturb = make_circle_masks(perturb_n, *init_state.shape[-2:])[:, None, ...]
    input_states[-perturb_n:] *= perturb
    states = model(input_states, np.random.randint(3, 6), seed_loc)
    final_rgba = states[-1, :, :4]
    mses = (target_rgba.unsqueeze(0) - final_rgba).pow(2)
    batch_mses = mses.view(batch_size, -1).mean(-1)
    loss = batch_mses.mean() ; loss.backward() ; normalize_grads(model)  # noqa: E702
    optimizer.step() ; optimizer.zero_grad() ; scheduler.step()  # noqa: E702
    ixs_to_replace = torch.argsort(batch_mses, descending=True)[:int(.5 * batch_size)]
    final_states = states[-1]
    final_states[ixs_to_replace] = init_state[:1]
    pool[pool_ixs] = final_states.cpu()
    del batch_mses
    print(f"step {step}: loss {loss.item()!r}")
print(f"checksum {sum(p.double().sum() for p in model.parameters()).item()!r} pool {pool.double().sum().item()!r}")
