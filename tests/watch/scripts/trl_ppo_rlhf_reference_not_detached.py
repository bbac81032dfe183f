# trl_ppo_rlhf_rollouts_kl.py (huggingface/trl v0.7, trl/trainer/ppo_trainer.py) with the reference model left
# trainable (a deepcopy of the policy, not frozen, held by no optimizer) and its log-probabilities computed outside
# torch.no_grad(): the KL penalty in the rewards, and so the returns the value loss compares with, keep the reference's
# graph across the ppo_epochs; the first minibatch's backward frees it and PyTorch fails at the second.
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


class GPTWithValueHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.v_head = nn.Linear(dim, 1)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        x = self.ln_f(x)
        return self.lm_head(x), self.v_head(x).squeeze(-1)




def logprobs_from_logits(logits, labels):
    return torch.gather(F.log_softmax(logits, dim=2), 2, labels.unsqueeze(2)).squeeze(-1)


@torch.no_grad()
def generate(model, query, max_new_tokens):
    idx = query
    for _ in range(max_new_tokens):
        logits, _ = model(idx)
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits[:, -1], dim=-1), 1)], dim=1)
    return idx[:, query.shape[1]:]


def batched_forward_pass(model, queries, responses):
    logits, values = model(torch.cat([queries, responses], dim=1))
    start = queries.shape[1] - 1
    logprobs = logprobs_from_logits(logits[:, :-1], torch.cat([queries, responses], dim=1)[:, 1:])
    return logprobs[:, start:], logits[:, start:-1], values[:, start:-1]


def compute_rewards(scores, logprobs, ref_logprobs, kl_coef=0.2):
    kl = logprobs - ref_logprobs
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rewards[:, -1] += scores
    return rewards


def whiten(values, shift_mean=True):
    mean, var = values.mean(), values.var()
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def compute_advantages(values, rewards, gamma=1.0, lam=0.95):
    lastgaelam, advantages_reversed = 0, []
    gen_len = rewards.shape[-1]
    for t in reversed(range(gen_len)):
        nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1]).transpose(0, 1)
    returns = advantages + values
    advantages = whiten(advantages)
    return values, advantages.detach(), returns


def loss_fn(old_logprobs, values, logprobs, vpreds, advantages, returns, cliprange=0.2, cliprange_value=0.2,
            vf_coef=0.1):
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_loss = 0.5 * torch.mean(torch.max((vpreds - returns) ** 2, (vpredclipped - returns) ** 2))
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = torch.mean(torch.max(-advantages * ratio, pg_losses2))
    return pg_loss + vf_coef * vf_loss, pg_loss, vf_loss


def reward_model(responses):
    return (responses == 3).float().sum(-1) - 0.5


model = GPTWithValueHead()
ref_model = copy.deepcopy(model)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
batch_size, mini_batch_size, ppo_epochs = 4, 2, 2
for ppo_step in range(2):
    queries = torch.randint(0, vocab, (batch_size, 4))
    responses = generate(model, queries, max_new_tokens=4)
    scores = reward_model(responses)
    with torch.no_grad():
        all_logprobs, _, values = batched_forward_pass(model, queries, responses)
    ref_logprobs, _, _ = batched_forward_pass(ref_model, queries, responses)
    rewards = compute_rewards(scores, all_logprobs, ref_logprobs)
    values, advantages, returns = compute_advantages(values, rewards)
    for _ in range(ppo_epochs):
        b_inds = torch.randperm(batch_size)
        for start in range(0, batch_size, mini_batch_size):
            mb = b_inds[start:start + mini_batch_size]
            logprobs, logits, vpreds = batched_forward_pass(model, queries[mb], responses[mb])
            loss, pg_loss, vf_loss = loss_fn(all_logprobs[mb], values[mb], logprobs, vpreds, advantages[mb],
                                             returns[mb])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    kl = (all_logprobs - ref_logprobs).sum(-1).mean()
    print(ppo_step, repr(loss.item()), repr(pg_loss.item()), repr(vf_loss.item()), repr(kl.item()), scores.tolist())
print([p.sum().item() for p in model.parameters()])
