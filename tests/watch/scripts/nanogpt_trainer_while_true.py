"""nanoGPT's training loop as a Trainer class (a port of karpathy/nanoGPT train.py, commit 005475c4): `while True`
in a method, the next batch prefetched into `self.X, self.Y` after the forward, micro-steps under `with self.ctx`
(bf16 autocast here), a GradScaler, gradient clipping and a `break` past max_iters. A tiny MLP on random tokens."""
import torch
from torch import nn
from torch.nn import functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.emb(idx)))
        return logits, F.cross_entropy(logits.float().view(-1, 16), targets.view(-1))


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = Model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        self.ctx = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
        self.iter_num, self.max_iters, self.accum = 0, 4, 2

    def get_batch(self):
        x = torch.randint(16, (4, 6))
        return x, (x + 1) % 16

    def train(self):
        self.X, self.Y = self.get_batch()
        while True:
            for micro_step in range(self.accum):
                with self.ctx:
                    logits, loss = self.model(self.X, self.Y)
                    loss = loss / self.accum
                self.X, self.Y = self.get_batch()
                self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            print(f"iter {self.iter_num}: loss {loss.item() * self.accum}")
            self.iter_num += 1
            if self.iter_num > self.max_iters:
                break


trainer = Trainer()
trainer.train()
for p in trainer.model.parameters():
    print(p.sum().item())
