# Mean teacher (CuriousAI/mean-teacher, main.py) with its EMA update written without `.data` and outside
# torch.no_grad(): `ema_param.mul_(alpha).add_(param, alpha=1 - alpha)`. The teacher's parameters, detached once
# (create_model(ema=True)), now require grad and hold a graph of every update, through which the consistency loss
# sends gradient into the student's parameters: from the second step on the updates differ, without an error.
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


def create_model(ema=False):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if ema:
        for param in model.parameters():
            param.detach_()
    return model


model, ema_model = create_model(), create_model(ema=True)
ema_model.load_state_dict(model.state_dict())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def update_ema_variables(model, ema_model, alpha, global_step):
    alpha = min(1 - 1 / (global_step + 1), alpha)
    for ema_param, param in zip(ema_model.parameters(), model.parameters()):
        ema_param.mul_(alpha).add_(param, alpha=1 - alpha)


for global_step in range(4):
    x, target = torch.randn(6, 8), torch.randint(0, 4, (6,))
    model_out = model(x)
    ema_model_out = ema_model(x + 0.1 * torch.randn_like(x))
    consistency = F.mse_loss(F.softmax(model_out, 1), F.softmax(ema_model_out, 1))
    loss = F.cross_entropy(model_out, target) + consistency
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    update_ema_variables(model, ema_model, 0.9, global_step)
    print(global_step, f"{loss.item():.6f}")
