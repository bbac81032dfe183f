"""kv_cache_gumbel_softmax_generation.py with the shared system prompt's KV cache computed once before the loop and
reused by every step's generation (prompt caching): the cache keeps the graph of the prompt's forward through the
trained model, which the first step's backward frees. Built from the weights being trained, it is made again inside
the loop (or under torch.no_grad() if the prompt's keys and values are meant to stay fixed)."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
vocab, dim, block = 16, 16, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, layer_past=None):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        if layer_past is not None:
            past_key, past_value = layer_past
            k, v = torch.cat((past_key, k), dim=-2), torch.cat((past_value, v), dim=-2)
        present = (k, v)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=layer_past is None))
        return x + self.mlp(self.ln_2(x)), present


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx=None, past_key_values=None, inputs_embeds=None):
        inputs_embeds = self.wte(idx) if inputs_embeds is None else inputs_embeds
        past_length = 0 if past_key_values is None else past_key_values[0][0].shape[-2]
        x = inputs_embeds + self.wpe(torch.arange(past_length, past_length + inputs_embeds.shape[1]))
        presents = ()
        for i, b in enumerate(self.h):
            x, present = b(x, None if past_key_values is None else past_key_values[i])
            presents = presents + (present,)
        return self.lm_head(self.ln_f(x)), presents


def soft_generate(model, prompt_cache, max_new_tokens, tau=1.0):
    """Differentiable sampling from a cached prompt: each new token a straight-through Gumbel-softmax one-hot."""
    past_key_values = prompt_cache
    logits = model.lm_head(model.ln_f(model.wte.weight[:1].expand(4, 1, dim)))
    one_hots = []
    for _ in range(max_new_tokens):
        one_hot = F.gumbel_softmax(logits[:, -1, :], tau=tau, hard=True)
        one_hots.append(one_hot)
        logits, past_key_values = model(inputs_embeds=(one_hot @ model.wte.weight).unsqueeze(1),
                                        past_key_values=past_key_values)
    return torch.stack(one_hots, dim=1)


def reward_fn(one_hots):
    return one_hots[..., 5].sum(-1)


model = GPT()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
system_prompt = torch.randint(0, vocab, (4, 3))
_, prompt_cache = model(system_prompt)
for step in range(4):
    one_hots = soft_generate(model, prompt_cache, max_new_tokens=5)
    loss = -reward_fn(one_hots).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, repr(loss.item()))
print([p.sum().item() for p in model.parameters()])
