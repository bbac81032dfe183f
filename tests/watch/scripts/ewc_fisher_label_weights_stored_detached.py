# EWC as in GMvandeVen/continual-learning (e6d795a), models/cl/continual_learner.py estimate_fisher (fisher_labels
# 'all': label weights under no_grad, one backward per label, retain_graph but for the last) and ewc_loss (online EWC,
# gamma), train/train_task_based.py and models/classifier.py train_a_batch (zero_grad, loss + reg_strength * ewc_loss,
# backward, step): two tasks of four steps each, the Fisher estimated between them. The label weights taken outside
# torch.no_grad() (the source's comment says they "shouldn't have gradient tracked"): the Fisher information keeps the
# graphs of the forwards it was estimated from, which its own backwards freed; the next task's first backward fails.
# The first fix applied as written: the estimate stored detached, which trains as the correct script.
import torch
import torch.nn.functional as F
from torch import nn


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.gamma = 1.0
        self.context_count = 0
        self.optimizer = torch.optim.Adam(self.parameters(), lr=1e-2, betas=(0.9, 0.999))

    def forward(self, x):
        return self.fc(x)

    def estimate_fisher(self, data):
        est_fisher_info = {n.replace('.', '__'): p.detach().clone().zero_() for n, p in self.named_parameters()}
        mode = self.training
        self.eval()
        for index, (x, y) in enumerate(data):
            output = self(x)
            label_weights = F.softmax(output, dim=1)
            for label_index in range(output.shape[1]):
                label = torch.LongTensor([label_index])
                negloglikelihood = F.cross_entropy(output, label)
                self.zero_grad()
                negloglikelihood.backward(retain_graph=True if (label_index + 1) < output.shape[1] else False)
                for n, p in self.named_parameters():
                    n = n.replace('.', '__')
                    if p.grad is not None:
                        est_fisher_info[n] += label_weights[0][label_index] * (p.grad.detach() ** 2)
        est_fisher_info = {n: p / index for n, p in est_fisher_info.items()}
        est_fisher_info = {n: p.detach() for n, p in est_fisher_info.items()}
        for n, p in self.named_parameters():
            n = n.replace('.', '__')
            self.register_buffer('{}_EWC_prev_context'.format(n), p.detach().clone())
            if hasattr(self, '{}_EWC_estimated_fisher'.format(n)):
                existing_values = getattr(self, '{}_EWC_estimated_fisher'.format(n))
                est_fisher_info[n] += self.gamma * existing_values
            self.register_buffer('{}_EWC_estimated_fisher'.format(n), est_fisher_info[n])
        self.context_count += 1
        self.train(mode=mode)

    def ewc_loss(self):
        try:
            losses = []
            for n, p in self.named_parameters():
                n = n.replace('.', '__')
                mean = getattr(self, '{}_EWC_prev_context'.format(n))
                fisher = self.gamma * getattr(self, '{}_EWC_estimated_fisher'.format(n))
                losses.append((fisher * (p - mean) ** 2).sum())
            return (1. / 2) * sum(losses)
        except AttributeError:
            return torch.tensor(0.)

    def train_a_batch(self, x, y):
        self.train()
        self.optimizer.zero_grad()
        loss_total = F.cross_entropy(self(x), y)
        loss_total += 100. * self.ewc_loss()
        loss_total.backward()
        self.optimizer.step()
        return loss_total.item()


torch.manual_seed(0)
model = Classifier()
tasks = [(torch.randn(32, 6) + 2 * t, torch.randint(0, 3, (32,))) for t in range(2)]
for context, (xs, ys) in enumerate(tasks, 1):
    for batch_index in range(4):
        x, y = xs[batch_index * 8:(batch_index + 1) * 8], ys[batch_index * 8:(batch_index + 1) * 8]
        print(f"context {context} batch {batch_index} loss {model.train_a_batch(x, y)!r}")
    model.estimate_fisher([(xs[i:i + 1], ys[i:i + 1]) for i in range(5)])
print(sum(p.sum() for p in model.parameters()).item(), model.fc__0__weight_EWC_estimated_fisher.sum().item())
