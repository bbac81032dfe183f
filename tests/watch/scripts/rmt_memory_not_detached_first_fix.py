# rmt_memory_not_detached.py with the first fix the guard gives applied as written, after the update: trains as
# rmt_memory_segments.py.
import torch
from torch import nn


class RMT(nn.Module):
    def __init__(self, d=8, n_mem=2):
        super().__init__()
        self.memory = nn.Parameter(torch.randn(n_mem, d) * 0.1)
        self.emb, self.mix, self.out = nn.Embedding(10, d), nn.Linear(2 * d, d), nn.Linear(d, 10)

    def forward(self, seg, memory):
        h = self.emb(seg)
        ctx = memory.mean(0, keepdim=True).expand_as(h)
        h = torch.tanh(self.mix(torch.cat([h, ctx], -1)))
        new_memory = torch.tanh(memory + h.mean(0, keepdim=True))
        return self.out(h), new_memory


torch.manual_seed(0)
model = RMT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for doc in range(2):
    tokens = torch.randint(0, 10, (19,))
    memory, losses = model.memory, []
    for i, s in enumerate(range(0, 18, 3)):
        logits, memory = model(tokens[s:s + 3], memory)
        losses.append(nn.functional.cross_entropy(logits, tokens[s + 1:s + 4]))
        if i % 3 == 2:
            loss = torch.stack(losses).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses = []
            memory = memory.detach()
            print(f"doc {doc} segment {i} loss {loss.item():.6f}")
print(model.memory.sum().item())
