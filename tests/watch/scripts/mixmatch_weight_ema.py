# MixMatch (YU1ut/MixMatch-pytorch, train.py): labels of two augmentations of the unlabeled batch guessed under
# no_grad and sharpened, labeled and unlabeled mixed up together, the batches interleaved, and WeightEMA stepping on
# the tensors of state_dict() (the EMA model's, and the model's own for its weight decay, written in place).
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
np.random.seed(0)


def create_model(ema=False):
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    if ema:
        for param in model.parameters():
            param.detach_()
    return model


model, ema_model = create_model(), create_model(ema=True)
optimizer = torch.optim.Adam(model.parameters(), lr=0.002)


class WeightEMA(object):
    def __init__(self, model, ema_model, alpha=0.999):
        self.alpha = alpha
        self.params = list(model.state_dict().values())
        self.ema_params = list(ema_model.state_dict().values())
        self.wd = 0.02 * 0.002
        for param, ema_param in zip(self.params, self.ema_params):
            param.data.copy_(ema_param.data)

    def step(self):
        one_minus_alpha = 1.0 - self.alpha
        for param, ema_param in zip(self.params, self.ema_params):
            ema_param.mul_(self.alpha)
            ema_param.add_(param * one_minus_alpha)
            param.mul_(1 - self.wd)  # customized weight decay


def interleave_offsets(batch, nu):
    groups = [batch // (nu + 1)] * (nu + 1)
    for x in range(batch - sum(groups)):
        groups[-x - 1] += 1
    offsets = [0]
    for g in groups:
        offsets.append(offsets[-1] + g)
    return offsets


def interleave(xy, batch):
    nu = len(xy) - 1
    offsets = interleave_offsets(batch, nu)
    xy = [[v[offsets[p]:offsets[p + 1]] for p in range(nu + 1)] for v in xy]
    for i in range(1, nu + 1):
        xy[0][i], xy[i][i] = xy[i][i], xy[0][i]
    return [torch.cat(v, dim=0) for v in xy]


ema_optimizer = WeightEMA(model, ema_model, alpha=0.999)
batch_size, T, alpha, lambda_u = 4, 0.5, 0.75, 75
for batch_idx in range(4):
    inputs_x, targets_x = torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,))
    inputs_u = torch.randn(batch_size, 6)
    inputs_u2 = inputs_u + 0.1 * torch.randn_like(inputs_u)
    targets_x = torch.zeros(batch_size, 3).scatter_(1, targets_x.view(-1, 1).long(), 1)
    with torch.no_grad():
        outputs_u = model(inputs_u)
        outputs_u2 = model(inputs_u2)
        p = (torch.softmax(outputs_u, dim=1) + torch.softmax(outputs_u2, dim=1)) / 2
        pt = p ** (1 / T)
        targets_u = pt / pt.sum(dim=1, keepdim=True)
        targets_u = targets_u.detach()
    all_inputs = torch.cat([inputs_x, inputs_u, inputs_u2], dim=0)
    all_targets = torch.cat([targets_x, targets_u, targets_u], dim=0)
    l = np.random.beta(alpha, alpha)
    l = max(l, 1 - l)
    idx = torch.randperm(all_inputs.size(0))
    mixed_input = l * all_inputs + (1 - l) * all_inputs[idx]
    mixed_target = l * all_targets + (1 - l) * all_targets[idx]
    mixed_input = list(torch.split(mixed_input, batch_size))
    mixed_input = interleave(mixed_input, batch_size)
    logits = [model(mixed_input[0])]
    for input in mixed_input[1:]:
        logits.append(model(input))
    logits = interleave(logits, batch_size)
    logits_x = logits[0]
    logits_u = torch.cat(logits[1:], dim=0)
    Lx = -torch.mean(torch.sum(F.log_softmax(logits_x, dim=1) * mixed_target[:batch_size], dim=1))
    probs_u = torch.softmax(logits_u, dim=1)
    Lu = torch.mean((probs_u - mixed_target[batch_size:]) ** 2)
    w = lambda_u * float(np.clip(batch_idx / 16, 0.0, 1.0))
    loss = Lx + w * Lu
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ema_optimizer.step()
    print(batch_idx, repr(loss.item()), repr(Lx.item()), repr(Lu.item()))
print([p.sum().item() for p in model.parameters()], [p.sum().item() for p in ema_model.parameters()])
