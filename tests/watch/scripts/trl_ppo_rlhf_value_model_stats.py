"""TRL's PPOTrainer after its rewrite (huggingface/trl, trl/trainer/ppo_trainer.py as PPOv2 before its removal in
5e90682: train(), with utils.py's batch_generation, forward and get_reward, core.py's masked_whiten). The rollout
under torch.no_grad(): generation's logits, the policy's and the reference policy's log-probabilities, the value
model's values and the reward model's scores, the per-token KL penalty and GAE; then num_ppo_epochs over shuffled
minibatches through PolicyAndValueWrapper (the policy and a value model with its own backbone, one optimizer), the
logits divided by the temperature in place, the statistics written into preallocated tensors under torch.no_grad().
An embedding and a GRU for each backbone on random queries; the reward model is another such network, frozen."""
import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
np.random.seed(0)
vocab, dim, context_length, response_length, temperature = 16, 12, 3, 4, 0.7
kl_coef, gamma, lam, cliprange, cliprange_value, vf_coef = 0.05, 1.0, 0.95, 0.2, 0.2, 0.1


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.gru = nn.Embedding(vocab, dim), nn.GRU(dim, dim, batch_first=True)

    def forward(self, input_ids):
        return self.gru(self.embed(input_ids))[0]


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model, self.lm_head = Backbone(), nn.Linear(dim, vocab)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


class ScoreModel(nn.Module):
    base_model_prefix = "model"

    def __init__(self):
        super().__init__()
        self.model, self.score = Backbone(), nn.Linear(dim, 1)


class PolicyAndValueWrapper(nn.Module):
    def __init__(self, policy, value_model):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.critic_backbone = getattr(value_model, value_model.base_model_prefix)

    def forward(self, input_ids):
        output = self.critic_backbone(input_ids)
        logits = self.value_model.score(output)
        return self.policy(input_ids), logits


def get_reward(model, query_responses, context_length):
    reward_logits = model.score(getattr(model, model.base_model_prefix)(query_responses))
    sequence_lengths = torch.full((query_responses.shape[0],), query_responses.shape[1] - 1)
    return reward_logits, reward_logits[torch.arange(reward_logits.size(0)), sequence_lengths].squeeze(-1)


@torch.no_grad()
def batch_generation(policy, queries):
    query_responses, scores = queries, []
    for _ in range(response_length):
        logits = policy(query_responses)[:, -1] / temperature
        scores.append(logits)
        query_responses = torch.cat([query_responses, torch.multinomial(F.softmax(logits, -1), 1)], 1)
    return query_responses, torch.stack(scores, 1)


def masked_whiten(values):
    mean, var = values.mean(), values.var()
    return (values - mean) * torch.rsqrt(var + 1e-8)


policy, value_model, reward_model = CausalLM(), ScoreModel(), ScoreModel()
ref_policy = copy.deepcopy(policy)
for module in [ref_policy, reward_model]:
    module.requires_grad_(False)
model = PolicyAndValueWrapper(policy, value_model)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-5)
local_batch_size, local_mini_batch_size, num_ppo_epochs = 4, 2, 2
stats_shape = (num_ppo_epochs, local_batch_size // local_mini_batch_size)
approxkl_stats, pg_loss_stats, vf_loss_stats = torch.zeros(stats_shape), torch.zeros(stats_shape), \
    torch.zeros(stats_shape)
for update in range(1, 4):
    with torch.no_grad():
        queries = torch.randint(0, vocab, (local_batch_size, context_length))
        query_responses, logitss = batch_generation(model.policy, queries)
        responses = query_responses[:, context_length:]
        all_logprob = F.log_softmax(logitss, dim=-1)
        logprobs = torch.gather(all_logprob, 2, responses.unsqueeze(-1)).squeeze(-1)
        ref_logits = ref_policy(query_responses)[:, context_length - 1: -1]
        ref_logits /= temperature + 1e-7
        ref_all_logprob = F.log_softmax(ref_logits, dim=-1)
        ref_logprobs = torch.gather(ref_all_logprob, 2, responses.unsqueeze(-1)).squeeze(-1)
        full_value, _ = get_reward(model.value_model, query_responses, context_length)
        values = full_value[:, context_length - 1: -1].squeeze(-1)
        _, scores = get_reward(reward_model, query_responses, context_length)
        kl = logprobs - ref_logprobs
        non_score_reward = -kl_coef * kl
        rewards = non_score_reward.clone()
        rewards[:, -1] += scores
        lastgaelam, advantages_reversed = 0, []
        gen_length = responses.shape[1]
        for t in reversed(range(gen_length)):
            nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
            delta = rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam = delta + gamma * lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], axis=1)
        returns = advantages + values
        advantages = masked_whiten(advantages)
    for ppo_epoch_idx in range(num_ppo_epochs):
        b_inds = np.random.permutation(local_batch_size)
        for minibatch_idx, mini_batch_start in enumerate(range(0, local_batch_size, local_mini_batch_size)):
            micro_batch_inds = b_inds[mini_batch_start:mini_batch_start + local_mini_batch_size]
            mb_advantage, mb_responses = advantages[micro_batch_inds], responses[micro_batch_inds]
            mb_query_responses, mb_logprobs = query_responses[micro_batch_inds], logprobs[micro_batch_inds]
            mb_return, mb_values = returns[micro_batch_inds], values[micro_batch_inds]
            output, vpred_temp = model(mb_query_responses)
            logits = output[:, context_length - 1: -1]
            logits /= temperature + 1e-7
            new_all_logprobs = F.log_softmax(logits, dim=-1)
            new_logprobs = torch.gather(new_all_logprobs, 2, mb_responses.unsqueeze(-1)).squeeze(-1)
            vpred = vpred_temp[:, context_length - 1: -1].squeeze(-1)
            vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
            vf_losses1 = torch.square(vpred - mb_return)
            vf_losses2 = torch.square(vpredclipped - mb_return)
            vf_loss = 0.5 * torch.max(vf_losses1, vf_losses2).mean()
            logprobs_diff = new_logprobs - mb_logprobs
            ratio = torch.exp(logprobs_diff)
            pg_losses = -mb_advantage * ratio
            pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
            pg_loss = torch.max(pg_losses, pg_losses2).mean()
            loss = pg_loss + vf_coef * vf_loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                approxkl = 0.5 * (logprobs_diff ** 2).mean()
                approxkl_stats[ppo_epoch_idx, minibatch_idx] = approxkl
                pg_loss_stats[ppo_epoch_idx, minibatch_idx] = pg_loss
                vf_loss_stats[ppo_epoch_idx, minibatch_idx] = vf_loss
    print(update, repr(loss.item()), repr(kl.sum(1).mean().item()), approxkl_stats.tolist(), pg_loss_stats.tolist(),
          vf_loss_stats.tolist(), scores.tolist())
print([p.sum().item() for p in model.parameters()])
