# kv_cache_object_carried.py with the first fix the guard gives applied as written: both lists of the cache
# detached at the end of each step (truncated backpropagation across segments, as Transformer-XL's memories).
import torch
from torch import nn


class DynamicCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)[..., -4:, :]
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)[..., -4:, :]
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class Attn(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, past_key_values, layer_idx=0):
        k, v = past_key_values.update(self.k(x), self.v(x), layer_idx)
        att = torch.softmax(self.q(x) @ k.transpose(-1, -2) / 8 ** 0.5, -1)
        return self.o(att @ v)


torch.manual_seed(0)
model = Attn()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
past_key_values = DynamicCache()
for step in range(4):
    x = torch.randn(2, 3, 8)
    out = model(x, past_key_values)
    loss = (out - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, loss.item())
    past_key_values.value_cache = [t.detach() for t in past_key_values.value_cache]; past_key_values.key_cache = [t.detach() for t in past_key_values.key_cache]
