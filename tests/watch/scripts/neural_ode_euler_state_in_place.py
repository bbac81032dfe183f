# A neural ODE (rtqichen/torchdiffeq, examples/ode_demo.py) with a hand-written Euler solver that advances its state
# in place (`y += dt * func(t, y)`): func's graph saved y (its `y ** 3`), which the write changes before the backward
# (PyTorch fails at the first backward).
import torch
from torch import nn

torch.manual_seed(0)
true_y0, t = torch.tensor([[2., 0.]]), torch.linspace(0., 5., 40)
true_A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]])


def odeint(func, y0, t):  # explicit Euler on the grid t
    y, ys = y0.clone(), [y0]
    for t0, t1 in zip(t[:-1], t[1:]):
        y += (t1 - t0) * func(t0, y)
        ys.append(y.clone())
    return torch.stack(ys)


class ODEFunc(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        for m in self.net.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0, std=0.1)
                nn.init.constant_(m.bias, val=0)

    def forward(self, t, y):
        return self.net(y ** 3)


class RunningAverageMeter:
    def __init__(self, momentum=0.99):
        self.momentum, self.val, self.avg = momentum, None, 0

    def update(self, val):
        self.avg = val if self.val is None else self.avg * self.momentum + val * (1 - self.momentum)
        self.val = val


with torch.no_grad():
    true_y = odeint(lambda t, y: torch.mm(y ** 3, true_A), true_y0, t)
func, loss_meter = ODEFunc(), RunningAverageMeter(0.97)
optimizer = torch.optim.RMSprop(func.parameters(), lr=1e-3)
for itr in range(1, 9):
    optimizer.zero_grad()
    s = torch.randperm(40 - 5)[:6]
    batch_y0, batch_t, batch_y = true_y[s], t[:5], torch.stack([true_y[s + i] for i in range(5)], dim=0)
    pred_y = odeint(func, batch_y0, batch_t)
    loss = torch.mean(torch.abs(pred_y - batch_y))
    loss.backward()
    optimizer.step()
    loss_meter.update(loss.item())
    if itr % 4 == 0:
        with torch.no_grad():
            print(itr, f"{torch.mean(torch.abs(odeint(func, true_y0, t) - true_y)).item():.6f} {loss_meter.avg:.6f}")
