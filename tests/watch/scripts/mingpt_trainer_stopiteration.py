"""minGPT's Trainer.run (karpathy/minGPT, mingpt/trainer.py): `while True` in a method, the next batch taken with
`try: batch = next(data_iter)` / `except StopIteration:` (a new epoch's iterator), `logits, self.loss = model(x, y)`
kept on the trainer for the callbacks, `self.loss.backward()`, clipping, `trigger_callbacks('on_batch_end')` and a
`break` at max_iters. A tiny embedding model on random tokens, 3 batches an epoch."""
from collections import defaultdict

import torch
from torch import nn
from torch.nn import functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.lm_head = nn.Embedding(12, 8), nn.Linear(8, 12)

    def forward(self, idx, targets=None):
        logits = self.lm_head(self.wte(idx).tanh())
        return logits, F.cross_entropy(logits.view(-1, 12), targets.view(-1), ignore_index=-1)


class Trainer:
    def __init__(self, model, train_dataset, max_iters):
        self.model, self.train_dataset, self.max_iters = model, train_dataset, max_iters
        self.callbacks, self.iter_num = defaultdict(list), 0

    def trigger_callbacks(self, onevent):
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self):
        model = self.model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.95))
        data_iter = iter(self.train_dataset)
        while True:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(self.train_dataset)
                batch = next(data_iter)
            x, y = batch
            logits, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self.optimizer.step()
            self.trigger_callbacks('on_batch_end')
            self.iter_num += 1
            if self.iter_num >= self.max_iters:
                break


torch.manual_seed(0)
data = [(torch.randint(12, (2, 5)), torch.randint(12, (2, 5))) for _ in range(3)]
trainer = Trainer(Model(), data, max_iters=7)
trainer.callbacks['on_batch_end'].append(lambda t: print(f"iter {t.iter_num}: train loss {t.loss.item()}"))
trainer.run()
for p in trainer.model.parameters():
    print(p.sum().item())
