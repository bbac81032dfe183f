"""openrlhf_experience_replay_buffer.py (OpenRLHF/OpenRLHF, openrlhf/trainer/ppo_utils/experience_maker.py) with
make_experience's @torch.no_grad() left out: every Experience in the replay buffer keeps the graph of the actor's
forward over its rollout (its old log-probabilities, and the advantages through the KL penalty), which the first
backward through it frees; PyTorch fails when the next epoch goes over the buffer again."""
import copy
from dataclasses import dataclass

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




@dataclass
class Experience:
    sequences: torch.Tensor
    action_log_probs: torch.Tensor
    base_action_log_probs: torch.Tensor
    advantages: torch.Tensor
    action_mask: torch.Tensor


class NaiveReplayBuffer:
    def __init__(self):
        self.items = []

    def append(self, experience):
        self.items.append(experience)

    def clear(self):
        self.items.clear()


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = GPT()

    def forward(self, sequences, num_actions):
        logits = self.model(sequences)
        log_probs = torch.gather(F.log_softmax(logits[:, :-1], dim=-1), 2, sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
        return log_probs[:, -num_actions:]

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens):
        for _ in range(max_new_tokens):
            probs = F.softmax(self.model(input_ids)[:, -1], dim=-1)
            input_ids = torch.cat([input_ids, torch.multinomial(probs, 1)], dim=1)
        return input_ids, torch.ones(input_ids.shape[0], max_new_tokens, dtype=torch.bool)


def compute_approx_kl(log_probs, log_probs_base, action_mask=None):
    log_ratio = log_probs.float() - log_probs_base.float()
    if action_mask is not None:
        log_ratio = log_ratio * action_mask
    return log_ratio


def compute_reward(r, kl_coef, kl, action_mask):
    kl_reward = -kl_coef * kl
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


def masked_mean(tensor, mask, dim=None):
    return (tensor * mask).sum(axis=dim) / mask.sum(axis=dim)


class PolicyLoss(nn.Module):
    def __init__(self, clip_eps=0.2):
        super().__init__()
        self.clip_eps = clip_eps

    def forward(self, log_probs, old_log_probs, advantages, action_mask):
        ratio = (log_probs - old_log_probs).exp()
        surr1 = ratio * advantages
        surr2 = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * advantages
        return masked_mean(-torch.min(surr1, surr2), action_mask, dim=-1).mean()


def make_experience(actor, initial_model, prompts, num_actions, kl_coef=0.01):
    actor.eval()
    sequences, action_mask = actor.generate(prompts, num_actions)
    action_log_probs = actor(sequences, num_actions)
    base_action_log_probs = initial_model(sequences, num_actions)
    r = (sequences[:, -num_actions:] == 7).float().sum(-1)
    kl = compute_approx_kl(action_log_probs, base_action_log_probs, action_mask=action_mask)
    reward = compute_reward(r, kl_coef, kl, action_mask=action_mask)
    returns = reward.flip(-1).cumsum(-1).flip(-1)
    actor.train()
    return Experience(sequences, action_log_probs, base_action_log_probs, returns - returns.mean(), action_mask)


actor = Actor()
initial_model = copy.deepcopy(actor)
initial_model.eval().requires_grad_(False)
actor_optim = torch.optim.Adam(actor.parameters(), lr=1e-3)
actor_loss_fn = PolicyLoss()
replay_buffer, max_epochs, num_actions = NaiveReplayBuffer(), 2, 3
for episode in range(2):
    for rand_prompts in torch.randint(0, vocab, (2, 4, 4)):
        replay_buffer.append(make_experience(actor, initial_model, rand_prompts, num_actions))
    for epoch in range(max_epochs):
        for experience in replay_buffer.items:
            action_log_probs = actor(experience.sequences, num_actions)
            actor_loss = actor_loss_fn(action_log_probs, experience.action_log_probs, experience.advantages,
                                       action_mask=experience.action_mask)
            actor_loss.backward()
            actor_optim.step()
            actor_optim.zero_grad()
    print(episode, repr(actor_loss.item()), [e.advantages.abs().sum().item() for e in replay_buffer.items])
    replay_buffer.clear()
print([p.sum().item() for p in actor.parameters()])
