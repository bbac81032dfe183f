# A neural ODE (rtqichen/torchdiffeq, examples/ode_demo.py, RK4 by hand) whose RunningAverageMeter is fed the loss
# tensor instead of loss.item(): its running average `avg * momentum + val * (1 - momentum)` chains every step's graph.
import torch
from torch import nn

torch.manual_seed(0)
true_y0, t = torch.tensor([[2., 0.]]), torch.linspace(0., 5., 40)
true_A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]])


def odeint(func, y0, t):  # classic RK4 on the grid t
    ys = [y0]
    for t0, t1 in zip(t[:-1], t[1:]):
        dt, y = t1 - t0, ys[-1]
        k1 = func(t0, y)
        k2 = func(t0 + dt / 2, y + dt * k1 / 2)
        k3 = func(t0 + dt / 2, y + dt * k2 / 2)
        k4 = func(t1, y + dt * k3)
        ys.append(y + dt * (k1 + 2 * k2 + 2 * k3 + k4) / 6)
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
    loss_meter.update(loss)
    if itr % 4 == 0:
        with torch.no_grad():
            error = torch.mean(torch.abs(odeint(func, true_y0, t) - true_y))
            print(itr, f"{error.item():.6f} {loss_meter.avg.item():.6f}")
