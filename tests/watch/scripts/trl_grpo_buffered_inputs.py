"""TRL's GRPOTrainer (huggingface/trl, trl/trainer/grpo_trainer.py: _generate_and_score_completions computes the
old and the reference per-token log-probabilities under torch.no_grad() and the group-normalised advantages, kept in
_buffered_inputs and reused for num_iterations updates; _compute_loss: the clipped ratio to the old log-probabilities
and the k3 estimate of the KL to the reference, beta-weighted). A 2-layer GPT on random prompts; the reward counts
a token of the completion."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
vocab, dim, block = 16, 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))




def selective_log_softmax(logits, index):
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def _get_per_token_logps(model, input_ids, logits_to_keep):
    logits = model(input_ids)[:, :-1, :]
    return selective_log_softmax(logits[:, -logits_to_keep:], input_ids[:, -logits_to_keep:])


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens):
    for _ in range(max_new_tokens):
        probs = F.softmax(model(prompt_ids)[:, -1], dim=-1)
        prompt_ids = torch.cat([prompt_ids, torch.multinomial(probs, 1)], dim=1)
    return prompt_ids


def _generate_and_score_completions(prompts, num_generations=4, logits_to_keep=4):
    prompt_completion_ids = generate(model, prompts.repeat_interleave(num_generations, dim=0), logits_to_keep)
    completion_ids = prompt_completion_ids[:, -logits_to_keep:]
    with torch.no_grad():
        old_per_token_logps = _get_per_token_logps(model, prompt_completion_ids, logits_to_keep)
        ref_per_token_logps = _get_per_token_logps(ref_model, prompt_completion_ids, logits_to_keep)
    rewards = (completion_ids == 2).float().sum(-1)
    mean_grouped_rewards = rewards.view(-1, num_generations).mean(dim=1).repeat_interleave(num_generations, dim=0)
    std_grouped_rewards = rewards.view(-1, num_generations).std(dim=1).repeat_interleave(num_generations, dim=0)
    advantages = (rewards - mean_grouped_rewards) / (std_grouped_rewards + 1e-4)
    return {"prompt_completion_ids": prompt_completion_ids, "old_per_token_logps": old_per_token_logps,
            "ref_per_token_logps": ref_per_token_logps, "advantages": advantages}


def _compute_loss(model, inputs, logits_to_keep=4, beta=0.04, epsilon=0.2):
    per_token_logps = _get_per_token_logps(model, inputs["prompt_completion_ids"], logits_to_keep)
    ref_per_token_logps = inputs["ref_per_token_logps"]
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    advantages = inputs["advantages"]
    coef_1 = torch.exp(per_token_logps - inputs["old_per_token_logps"])
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2) + beta * per_token_kl
    return per_token_loss.mean(), per_token_kl.mean()


model = GPT()
ref_model = copy.deepcopy(model)
ref_model.requires_grad_(False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
num_iterations, _buffered_inputs = 2, None
for global_step in range(4):
    if global_step % num_iterations == 0:
        _buffered_inputs = _generate_and_score_completions(torch.randint(0, vocab, (2, 4)))
    loss, mean_kl = _compute_loss(model, _buffered_inputs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    print(global_step, repr(loss.item()), repr(mean_kl.item()))
print([p.sum().item() for p in model.parameters()])
