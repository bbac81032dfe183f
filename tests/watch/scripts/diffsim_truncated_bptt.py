# A differentiable simulator unrolled over time with truncated backprop (as in the DiffTaichi / brax-style controller
# tutorials, in plain torch): a controller network pushes a point mass towards a target; every k simulation steps the
# summed distance is back-propagated through those k steps, the controller updated, and the state (position and
# velocity) detached so the next window starts from its values without the last window's graph.
import torch
import torch.nn as nn

torch.manual_seed(0)
controller = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
opt = torch.optim.Adam(controller.parameters(), lr=0.01)
target, dt, k = torch.tensor([1.0, 0.5]), 0.1, 5
pos, vel = torch.zeros(2), torch.zeros(2)
for window in range(4):
    loss = 0
    for t in range(k):
        force = controller(torch.cat([pos, vel]))
        vel = vel + dt * (force - 0.1 * vel)
        pos = pos + dt * vel
        loss = loss + (pos - target).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    pos = pos.detach(); vel = vel.detach()
    print(f"{loss.item():.6f}")
print(" ".join(f"{v:.6f}" for v in [*pos.tolist(), *vel.tolist()]))
