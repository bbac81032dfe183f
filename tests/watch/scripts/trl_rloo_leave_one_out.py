"""TRL's RLOOTrainer before its GRPO-style rewrite (huggingface/trl, trl/trainer/rloo_trainer.py at 5e90682^:
train()). Each query repeated rloo_k times; under torch.no_grad(): generation, the policy's and the reference
policy's per-token log-probabilities, the reward model's scores, the sequence-level KL penalty and the leave-one-out
baseline `(rlhf_reward.sum(0) - rlhf_reward) / (rloo_k - 1)`; then num_ppo_epochs over shuffled minibatches with the
clipped ratio of the summed log-probabilities, optimizer.step() and zero_grad() right after each backward. An
embedding and a GRU on random queries; the reward model is another such network, frozen."""
import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
np.random.seed(0)
vocab, dim, context_length, response_length, temperature = 16, 12, 3, 4, 0.7
rloo_k, kl_coef, cliprange = 2, 0.05, 0.2


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.gru, self.lm_head = nn.Embedding(vocab, dim), nn.GRU(dim, dim, batch_first=True), \
            nn.Linear(dim, vocab)

    def forward(self, input_ids):
        return self.lm_head(self.gru(self.embed(input_ids))[0])


class RewardModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.gru, self.score = nn.Embedding(vocab, dim), nn.GRU(dim, dim, batch_first=True), \
            nn.Linear(dim, 1)

    def forward(self, input_ids):
        return self.score(self.gru(self.embed(input_ids))[0])[:, -1, 0]


@torch.no_grad()
def batch_generation(model, queries):
    query_responses, scores = queries, []
    for _ in range(response_length):
        logits = model(query_responses)[:, -1] / temperature
        scores.append(logits)
        query_responses = torch.cat([query_responses, torch.multinomial(F.softmax(logits, -1), 1)], 1)
    return query_responses, torch.stack(scores, 1)


model, reward_model = CausalLM(), RewardModel()
ref_policy = copy.deepcopy(model)
for module in [ref_policy, reward_model]:
    module.requires_grad_(False)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-5)
local_batch_size, local_mini_batch_size, num_ppo_epochs = 4 * rloo_k, 4, 2
stats_shape = (num_ppo_epochs, local_batch_size // local_mini_batch_size)
approxkl_stats, pg_loss_stats = torch.zeros(stats_shape), torch.zeros(stats_shape)
for update in range(1, 4):
    with torch.no_grad():
        queries = torch.randint(0, vocab, (local_batch_size // rloo_k, context_length)).repeat(rloo_k, 1)
        query_responses, logitss = batch_generation(model, queries)
        responses = query_responses[:, context_length:]
        all_logprob = F.log_softmax(logitss, dim=-1)
        logprobs = torch.gather(all_logprob, 2, responses.unsqueeze(-1)).squeeze(-1)
        ref_logits = ref_policy(query_responses)[:, context_length - 1: -1]
        ref_logits /= temperature + 1e-7
        ref_all_logprob = F.log_softmax(ref_logits, dim=-1)
        ref_logprobs = torch.gather(ref_all_logprob, 2, responses.unsqueeze(-1)).squeeze(-1)
        scores = reward_model(query_responses)
        kl = logprobs - ref_logprobs
        non_score_reward = (-kl_coef * kl).sum(1)
        rlhf_reward = scores + non_score_reward
        rlhf_reward = rlhf_reward.reshape(rloo_k, -1)
        baseline = (rlhf_reward.sum(0) - rlhf_reward) / (rloo_k - 1)
        advantages = rlhf_reward - baseline
        advantages = advantages.flatten()
    for ppo_epoch_idx in range(num_ppo_epochs):
        b_inds = np.random.permutation(local_batch_size)
        for minibatch_idx, mini_batch_start in enumerate(range(0, local_batch_size, local_mini_batch_size)):
            micro_batch_inds = b_inds[mini_batch_start:mini_batch_start + local_mini_batch_size]
            mb_advantage, mb_responses = advantages[micro_batch_inds], responses[micro_batch_inds]
            mb_query_responses, mb_logprobs = query_responses[micro_batch_inds], logprobs[micro_batch_inds]
            logits = model(mb_query_responses)[:, context_length - 1: -1]
            logits /= temperature + 1e-7
            new_all_logprobs = F.log_softmax(logits, dim=-1)
            new_logprobs = torch.gather(new_all_logprobs, 2, mb_responses.unsqueeze(-1)).squeeze(-1)
            new_ratio = (new_logprobs - mb_logprobs).exp()
            new_logprobs = new_logprobs.sum(1)
            mb_logprobs = mb_logprobs.sum(1)
            logprobs_diff = new_logprobs - mb_logprobs
            ratio = torch.exp(logprobs_diff)
            pg_losses = -mb_advantage * ratio
            pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
            pg_loss = torch.max(pg_losses, pg_losses2).mean()
            loss = pg_loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                approxkl = 0.5 * (logprobs_diff ** 2).mean()
                approxkl_stats[ppo_epoch_idx, minibatch_idx] = approxkl
                pg_loss_stats[ppo_epoch_idx, minibatch_idx] = pg_loss
    print(update, repr(loss.item()), repr(kl.sum(1).mean().item()), approxkl_stats.tolist(), pg_loss_stats.tolist(),
          scores.tolist())
print([p.sum().item() for p in model.parameters()])
