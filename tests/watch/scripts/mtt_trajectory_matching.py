# Trimmed from GeorgeCazenavette/mtt-distillation, distill.py (the training loop) and reparam_module.py
# (`ReparamModule`): dataset distillation by matching training trajectories. Each iteration makes a new student whose
# parameters are flattened into one tensor; a list of student parameters starts from an expert's checkpoint
# (`.requires_grad_(True)` on a copy) and grows by unrolled steps `student_params[-1] - syn_lr * grad`, each gradient
# taken with `create_graph=True`; the distance to a later checkpoint trains the synthetic images and the learnable
# learning rate `syn_lr`, each with its own optimizer. The expert trajectories (buffer.py's) are random here.
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn as nn

torch.manual_seed(0)
np.random.seed(0)
num_classes, ipc, channel, im_size = 2, 2, 1, (6, 6)
Iteration, syn_steps, expert_epochs, max_start_epoch, batch_syn = 4, 3, 2, 2, 2


class ReparamModule(nn.Module):
    def _get_module_from_name(self, mn):
        if mn == '':
            return self
        m = self
        for p in mn.split('.'):
            m = getattr(m, p)
        return m

    def __init__(self, module):
        super(ReparamModule, self).__init__()
        self.module = module
        param_infos, params, param_numels, param_shapes = [], [], [], []
        for mn, m in self.named_modules():
            for n, p in m.named_parameters(recurse=False):
                if p is not None:
                    param_infos.append((mn, n))
                    params.append(p.detach())
                    param_numels.append(p.numel())
                    param_shapes.append(p.size())
        self._param_infos = tuple(param_infos)
        self._param_numels = tuple(param_numels)
        self._param_shapes = tuple(param_shapes)
        flat_param = nn.Parameter(torch.cat([p.reshape(-1) for p in params], 0))
        self.register_parameter('flat_param', flat_param)
        self.param_numel = flat_param.numel()
        for mn, n in self._param_infos:
            delattr(self._get_module_from_name(mn), n)
        self._unflatten_param(self.flat_param)

    def _unflatten_param(self, flat_param):
        ps = (t.view(s) for (t, s) in zip(flat_param.split(self._param_numels), self._param_shapes))
        for (mn, n), p in zip(self._param_infos, ps):
            setattr(self._get_module_from_name(mn), n, p)  # This will set as plain attr

    @contextmanager
    def unflattened_param(self, flat_param):
        saved_views = [getattr(self._get_module_from_name(mn), n) for mn, n in self._param_infos]
        self._unflatten_param(flat_param)
        yield
        for (mn, n), p in zip(self._param_infos, saved_views):
            setattr(self._get_module_from_name(mn), n, p)

    def forward(self, *inputs, flat_param=None, **kwinputs):
        flat_param = torch.squeeze(flat_param)
        with self.unflattened_param(flat_param):
            return self.module(*inputs, **kwinputs)


def get_network():
    return nn.Sequential(nn.Conv2d(channel, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 9, num_classes))


# the expert trajectories: a list of checkpoints (lists of tensors) per expert
buffer = []
for _ in range(2):
    net = get_network()
    trajectory = [[p.detach().clone() for p in net.parameters()]]
    for e in range(max_start_epoch + expert_epochs):
        trajectory.append([p + 0.05 * torch.randn_like(p) for p in trajectory[-1]])
    buffer.append(trajectory)

label_syn = torch.tensor(np.array([np.ones(ipc, dtype=np.int_) * i for i in range(num_classes)]),
                         dtype=torch.long, requires_grad=False).view(-1)
image_syn = torch.randn(size=(num_classes * ipc, channel, im_size[0], im_size[1]), dtype=torch.float)
syn_lr = torch.tensor(0.01)
image_syn = image_syn.detach().requires_grad_(True)
syn_lr = syn_lr.detach().requires_grad_(True)
optimizer_img = torch.optim.SGD([image_syn], lr=100, momentum=0.5)
optimizer_lr = torch.optim.SGD([syn_lr], lr=1e-05, momentum=0.5)
optimizer_img.zero_grad()
criterion = nn.CrossEntropyLoss()
expert_idx = 0

for it in range(0, Iteration + 1):
    student_net = ReparamModule(get_network())
    student_net.train()
    num_params = sum([np.prod(p.size()) for p in (student_net.parameters())])

    expert_trajectory = buffer[expert_idx]
    expert_idx = (expert_idx + 1) % len(buffer)
    start_epoch = np.random.randint(0, max_start_epoch)
    starting_params = expert_trajectory[start_epoch]
    target_params = expert_trajectory[start_epoch + expert_epochs]
    target_params = torch.cat([p.data.reshape(-1) for p in target_params], 0)
    student_params = [torch.cat([p.data.reshape(-1) for p in starting_params], 0).requires_grad_(True)]
    starting_params = torch.cat([p.data.reshape(-1) for p in starting_params], 0)

    syn_images = image_syn
    y_hat = label_syn
    indices_chunks = []
    for step in range(syn_steps):
        if not indices_chunks:
            indices = torch.randperm(len(syn_images))
            indices_chunks = list(torch.split(indices, batch_syn))
        these_indices = indices_chunks.pop()
        x = syn_images[these_indices]
        this_y = y_hat[these_indices]
        forward_params = student_params[-1]
        x = student_net(x, flat_param=forward_params)
        ce_loss = criterion(x, this_y)
        grad = torch.autograd.grad(ce_loss, student_params[-1], create_graph=True)[0]
        student_params.append(student_params[-1] - syn_lr * grad)

    param_loss = torch.tensor(0.0)
    param_dist = torch.tensor(0.0)
    param_loss += torch.nn.functional.mse_loss(student_params[-1], target_params, reduction="sum")
    param_dist += torch.nn.functional.mse_loss(starting_params, target_params, reduction="sum")
    param_loss /= num_params
    param_dist /= num_params
    param_loss /= param_dist
    grand_loss = param_loss

    optimizer_img.zero_grad()
    optimizer_lr.zero_grad()
    grand_loss.backward()
    optimizer_img.step()
    optimizer_lr.step()

    for _ in student_params:
        del _
    print(f"iter {it} loss {grand_loss.item()!r} syn_lr {syn_lr.item()!r}")
print("image_syn", image_syn.detach().sum().item(), image_syn.detach().pow(2).sum().item())
