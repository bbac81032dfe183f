# Trimmed from huggingface/transformers, src/transformers/models/gpt2/modeling_gpt2.py (blocks run through
# torch.utils.checkpoint when gradient_checkpointing is on, training only) and its no-Trainer loop: one model with
# use_reentrant=True (the embedding's output requires grad), one with use_reentrant=False (the recomputation keeps
# the dropout's random state). Correct: nothing to report.
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(self.ln(x))))


class Model(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.wte, self.h, self.head = nn.Embedding(11, 8), nn.ModuleList(Block(8) for _ in range(3)), nn.Linear(8, 11)
        self.use_reentrant = use_reentrant

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant) if self.training else block(x)
        return self.head(x)


torch.manual_seed(0)
for use_reentrant in (True, False):
    model = Model(use_reentrant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, 11, (4, 6))
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"use_reentrant={use_reentrant} step {step} loss {loss.item():.6f}")
    model.eval()
    with torch.no_grad():
        print(model(ids).sum().item())
