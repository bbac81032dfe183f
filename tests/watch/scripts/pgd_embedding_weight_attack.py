# watch: --check always
# PGD adversarial training on the embedding matrix, as Chinese NLP code writes it (xiangking/ark-nlp,
# ark_nlp/factory/utils/attack.py, class PGD and its docstring's loop): after the clean backward the gradients are
# backed up; each of K attacks moves the embedding weight along its gradient through `.data` (backed up at the first
# one, projected back into an epsilon ball by assigning `param.data`), the gradients are cleared except before the
# last attack, which puts the clean ones back (`param.grad = backup`); the weight is restored (`param.data = backup`)
# before the optimizer step.
import hashlib

import torch
import torch.nn.functional as F
from torch import nn


class PGD(object):
    def __init__(self, module):
        self.module = module
        self.emb_backup = {}
        self.grad_backup = {}

    def attack(self, epsilon=1., alpha=0.3, emb_name='emb.', is_first_attack=False):
        for name, param in self.module.named_parameters():
            if param.requires_grad and emb_name in name:
                if is_first_attack:
                    self.emb_backup[name] = param.data.clone()
                norm = torch.norm(param.grad)
                if norm != 0 and not torch.isnan(norm):
                    r_at = alpha * param.grad / norm
                    param.data.add_(r_at)
                    param.data = self.project(name, param.data, epsilon)

    def restore(self, emb_name='emb.'):
        for name, param in self.module.named_parameters():
            if param.requires_grad and emb_name in name:
                assert name in self.emb_backup
                param.data = self.emb_backup[name]
        self.emb_backup = {}

    def project(self, param_name, param_data, epsilon):
        r = param_data - self.emb_backup[param_name]
        if torch.norm(r) > epsilon:
            r = epsilon * r / torch.norm(r)
        return self.emb_backup[param_name] + r

    def backup_grad(self):
        for name, param in self.module.named_parameters():
            if param.requires_grad and param.grad is not None:
                self.grad_backup[name] = param.grad.clone()

    def restore_grad(self):
        for name, param in self.module.named_parameters():
            if param.requires_grad and param.grad is not None:
                param.grad = self.grad_backup[name]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, input_ids):
        return self.fc(torch.tanh(self.emb(input_ids)).mean(1))


torch.manual_seed(0)
module = Model()
optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
pgd = PGD(module)
K = 3
data = [(torch.randint(20, (4, 6)), torch.randint(3, (4,))) for _ in range(5)]
for step, (batch_input, batch_label) in enumerate(data):
    loss = F.cross_entropy(module(batch_input), batch_label)
    loss.backward()
    pgd.backup_grad()
    for t in range(K):
        pgd.attack(is_first_attack=(t == 0))
        if t != K - 1:
            optimizer.zero_grad()
        else:
            pgd.restore_grad()
        loss_adv = F.cross_entropy(module(batch_input), batch_label)
        loss_adv.backward()
    pgd.restore()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item()!r} adv {loss_adv.item()!r}")
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest())
