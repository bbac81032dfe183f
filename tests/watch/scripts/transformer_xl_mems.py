# Trimmed from kimiyoung/transformer-xl, pytorch/mem_transformer.py (MemTransformerLM._update_mems, _forward) and
# pytorch/train.py: memories of earlier segments carried across steps as the tuple the model returns, each made
# again under no_grad from the concatenation of old memory and new hidden states, detached. Correct.
import torch
from torch import nn


class MemTransformerLM(nn.Module):
    def __init__(self, n_token=13, d=8, n_layer=2, mem_len=4):
        super().__init__()
        self.emb, self.out = nn.Embedding(n_token, d), nn.Linear(d, n_token)
        self.layers = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(n_layer))
        self.mem_len = mem_len

    def _update_mems(self, hids, mems, qlen, mlen):
        with torch.no_grad():
            new_mems = []
            end_idx = mlen + max(0, qlen)
            beg_idx = max(0, end_idx - self.mem_len)
            for i in range(len(hids)):
                cat = torch.cat([mems[i], hids[i]], dim=0)
                new_mems.append(cat[beg_idx:end_idx].detach())
        return new_mems

    def forward(self, data, target, *mems):
        if not mems:
            mems = [torch.zeros(0, data.size(1), self.emb.embedding_dim) for _ in range(len(self.layers) + 1)]
        core_out, hids = self.emb(data), []
        hids.append(core_out)
        for i, layer in enumerate(self.layers):
            ctx = torch.cat([mems[i], core_out], 0).mean(0, keepdim=True).expand_as(core_out)
            core_out = torch.tanh(layer(torch.cat([core_out, ctx], -1)))
            hids.append(core_out)
        new_mems = self._update_mems(hids, mems, data.size(0), mems[0].size(0))
        loss = nn.functional.cross_entropy(self.out(core_out).flatten(0, 1), target.flatten(), reduction="none")
        return [loss.view(target.shape)] + new_mems


torch.manual_seed(0)
model = MemTransformerLM()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
stream = torch.randint(0, 13, (25, 2))
mems = tuple()
for batch, i in enumerate(range(0, 24, 3)):
    data, target = stream[i:i + 3], stream[i + 1:i + 4]
    model.zero_grad()
    ret = model(data, target, *mems)
    loss, mems = ret[0], ret[1:]
    loss = loss.float().mean().type_as(loss)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
    print(f"batch {batch} loss {loss.item():.6f}")
print(model.out.weight.sum().item())
