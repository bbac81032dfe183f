# Synaptic Intelligence as in GMvandeVen/continual-learning (e6d795a), models/cl/continual_learner.py
# (register_starting_param_values, prepare_importance_estimates_dicts, update_importance_estimates: the path integral
# W[n] += -p.grad * (p.detach() - p_old[n]) after each update, update_omega after each context, surrogate_loss) and
# train/train_task_based.py (train_a_batch, then the estimates updated): two contexts of four steps each.
# Correct: nothing to report.
import torch
import torch.nn.functional as F
from torch import nn


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.epsilon = 0.1
        self.optimizer = torch.optim.Adam(self.parameters(), lr=1e-2, betas=(0.9, 0.999))

    def forward(self, x):
        return self.fc(x)

    def register_starting_param_values(self):
        for n, p in self.named_parameters():
            if p.requires_grad:
                n = n.replace('.', '__')
                self.register_buffer('{}_SI_prev_context'.format(n), p.detach().clone())

    def prepare_importance_estimates_dicts(self):
        W = {}
        p_old = {}
        for n, p in self.named_parameters():
            if p.requires_grad:
                n = n.replace('.', '__')
                W[n] = p.data.clone().zero_()
                p_old[n] = p.data.clone()
        return W, p_old

    def update_importance_estimates(self, W, p_old):
        for n, p in self.named_parameters():
            if p.requires_grad:
                n = n.replace('.', '__')
                if p.grad is not None:
                    W[n].add_(-p.grad * (p.detach() - p_old[n]))
                p_old[n] = p.detach().clone()

    def update_omega(self, W, epsilon):
        for n, p in self.named_parameters():
            if p.requires_grad:
                n = n.replace('.', '__')
                p_prev = getattr(self, '{}_SI_prev_context'.format(n))
                p_current = p.detach().clone()
                p_change = p_current - p_prev
                omega_add = W[n] / (p_change ** 2 + epsilon)
                try:
                    omega = getattr(self, '{}_SI_omega'.format(n))
                except AttributeError:
                    omega = p.detach().clone().zero_()
                omega_new = omega + omega_add
                self.register_buffer('{}_SI_prev_context'.format(n), p_current)
                self.register_buffer('{}_SI_omega'.format(n), omega_new)

    def surrogate_loss(self):
        try:
            losses = []
            for n, p in self.named_parameters():
                if p.requires_grad:
                    n = n.replace('.', '__')
                    prev_values = getattr(self, '{}_SI_prev_context'.format(n))
                    omega = getattr(self, '{}_SI_omega'.format(n))
                    losses.append((omega * (p - prev_values) ** 2).sum())
            return sum(losses)
        except AttributeError:
            return torch.tensor(0.)

    def train_a_batch(self, x, y):
        self.train()
        self.optimizer.zero_grad()
        loss_total = F.cross_entropy(self(x), y)
        loss_total += 10. * self.surrogate_loss()
        loss_total.backward()
        self.optimizer.step()
        return loss_total.item()


torch.manual_seed(0)
model = Classifier()
model.register_starting_param_values()
tasks = [(torch.randn(32, 6) + 2 * t, torch.randint(0, 3, (32,))) for t in range(2)]
for context, (xs, ys) in enumerate(tasks, 1):
    W, p_old = model.prepare_importance_estimates_dicts()
    for batch_index in range(4):
        x, y = xs[batch_index * 8:(batch_index + 1) * 8], ys[batch_index * 8:(batch_index + 1) * 8]
        print(f"context {context} batch {batch_index} loss {model.train_a_batch(x, y)!r}")
        model.update_importance_estimates(W, p_old)
    model.update_omega(W, model.epsilon)
print(sum(p.sum() for p in model.parameters()).item(), model.fc__0__weight_SI_omega.sum().item())
