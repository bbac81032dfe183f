"""Generation with a KV cache inside the training step, differentiated through: the 2-layer GPT of
kv_cache_sampling_reinforce.py (transformers' GPT-2 layer_past and inputs_embeds) sampling with straight-through
Gumbel-softmax (torch.nn.functional.gumbel_softmax, hard=True), each one-hot token embedded through wte.weight and
fed with the cache, the reward a differentiable count of a token, as text GANs and prompt optimisers train a
generator end to end. The cache holds this step's graph only, made again each step."""
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


def soft_generate(model, input_ids, max_new_tokens, tau=1.0):
    """Differentiable sampling: each new token a straight-through Gumbel-softmax one-hot, embedded as
    one_hot @ wte.weight and fed with the KV cache (the generation's graph runs through the cache)."""
    logits, past_key_values = model(input_ids)
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
for step in range(4):
    prompts = torch.randint(0, vocab, (4, 3))
    one_hots = soft_generate(model, prompts, max_new_tokens=5)
    loss = -reward_fn(one_hots).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, repr(loss.item()))
print([p.sum().item() for p in model.parameters()])
