"""Sampling with a KV cache inside the training loop, for a reward: a 2-layer GPT whose attention returns its keys
and values and takes past_key_values (huggingface/transformers, models/gpt2/modeling_gpt2.py: layer_past, `present`),
generate() as GenerationMixin runs it (decorated with @torch.no_grad(): the prompt's forward, then one token at a
time over the cache), and the REINFORCE-with-leave-one-out-baseline update of TRL's RLOOTrainer (huggingface/trl,
trl/trainer/rloo_trainer.py) from a fresh forward over prompt and completions. The reward counts a token."""
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

    def forward(self, idx, past_key_values=None):
        past_length = 0 if past_key_values is None else past_key_values[0][0].shape[-2]
        x = self.wte(idx) + self.wpe(torch.arange(past_length, past_length + idx.shape[1]))
        presents = ()
        for i, b in enumerate(self.h):
            x, present = b(x, None if past_key_values is None else past_key_values[i])
            presents = presents + (present,)
        return self.lm_head(self.ln_f(x)), presents


@torch.no_grad()
def generate(model, input_ids, max_new_tokens, temperature=1.0):
    past_key_values, next_input = None, input_ids
    for _ in range(max_new_tokens):
        logits, past_key_values = model(next_input, past_key_values=past_key_values)
        probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
        next_input = torch.multinomial(probs, num_samples=1)
        input_ids = torch.cat([input_ids, next_input], dim=-1)
    return input_ids


def reward_fn(completions):
    return (completions == 5).float().sum(-1)


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
rloo_k, context_length, response_length = 4, 4, 6
for update in range(4):
    queries = torch.randint(0, vocab, (2, context_length)).repeat(rloo_k, 1)
    model.eval()
    query_responses = generate(model, queries, response_length)
    model.train()
    responses = query_responses[:, context_length:]
    scores = reward_fn(responses)
    rlhf_reward = scores.reshape(rloo_k, -1)
    baseline = (rlhf_reward.sum(0) - rlhf_reward) / (rloo_k - 1)
    advantages = (rlhf_reward - baseline).flatten()
    logits, _ = model(query_responses)
    logits = logits[:, context_length - 1:-1]
    new_logprobs = torch.gather(F.log_softmax(logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1).sum(1)
    pg_loss = (-advantages * new_logprobs).mean()
    pg_loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(update, repr(pg_loss.item()), scores.mean().item())
print([p.sum().item() for p in model.parameters()])
