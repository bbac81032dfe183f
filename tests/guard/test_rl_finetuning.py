"""Reinforcement-learning fine-tuning of a causal language model under GraphGuard: GRPO as huggingface/trl trains it
(trl/trainer/grpo_trainer.py: old and reference per-token log-probabilities under ``torch.no_grad()`` in
``_generate_and_score_completions``, group-normalised advantages, the buffered inputs reused for ``num_iterations``
updates; ``_compute_loss``: the clipped ratio and the k3 estimate of the KL to the reference) and as
lsdefine/simple_GRPO does (grpo_vllm_one.py ``GRPO_step``: ``exp(per_token_logps - per_token_logps.detach())``);
PPO as trl's PPOv2 (trl/trainer/ppo_trainer.py before its removal in 5e90682: rollout under ``torch.no_grad()``,
KL-penalised rewards, GAE, ``num_ppo_epochs`` over minibatches through ``PolicyAndValueWrapper``, statistics written
under ``torch.no_grad()``); RLOO as trl's rloo_trainer.py of the same commit (leave-one-out baseline). The mistakes
written against them: old log-probabilities kept with their graph for ``num_iterations`` updates, the reference model
being the policy itself (huggingface/trl#2046), the rollout outside ``torch.no_grad()``, the statistics or the
minibatches' log-probabilities kept with their graphs across updates. An embedding, a GRU and a head; random
prompts."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import CarriedGraphError, GraphGuard, GraphLeakWarning, NoGraphError
from tests.guard.runs import bare, quietly, same

MODES = ["always", "auto", "off"]
VOCAB, DIM, PROMPT, NEW, TEMPERATURE = 16, 12, 3, 4, 0.7


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.gru = nn.Embedding(VOCAB, DIM), nn.GRU(DIM, DIM, batch_first=True)

    def forward(self, input_ids):
        return self.gru(self.embed(input_ids))[0]


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model, self.lm_head = Backbone(), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


@torch.no_grad()
def generate(model, input_ids, temperature=1.0):
    """Sampled completions of NEW tokens, and their logits (as ``output.scores``)."""
    scores = []
    for _ in range(NEW):
        logits = model(input_ids)[:, -1] / temperature
        scores.append(logits)
        input_ids = torch.cat([input_ids, torch.multinomial(F.softmax(logits, -1), 1)], 1)
    return input_ids, torch.stack(scores, 1)


# GRPO (trl's GRPOTrainer, written as one loop)

def selective_log_softmax(logits, index):
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def get_per_token_logps(model, input_ids, logits_to_keep=NEW):
    logits = model(input_ids)[:, :-1, :]
    return selective_log_softmax(logits[:, -logits_to_keep:], input_ids[:, -logits_to_keep:])


def grpo(check: str | None, mistake: str = "") -> list[torch.Tensor]:
    """Four updates, each generation (two prompts, four completions each) used for two. ``mistake``: ``"old"``, the
    old log-probabilities computed without ``torch.no_grad()``; ``"ref_is_policy"``, ``ref_model = model`` before
    ``ref_model.requires_grad_(False)``."""
    torch.manual_seed(0)
    model = CausalLM()
    ref_model = model if mistake == "ref_is_policy" else copy.deepcopy(model)
    ref_model.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = GraphGuard(model, optimizer, check=check) if check else None
    num_iterations, num_generations, beta, epsilon, _buffered_inputs = 2, 4, 0.04, 0.2, None
    for global_step in range(4):
        if global_step % num_iterations == 0:
            prompt_ids = torch.randint(0, VOCAB, (2, PROMPT)).repeat_interleave(num_generations, dim=0)
            prompt_completion_ids, _ = generate(model, prompt_ids)
            with torch.no_grad():
                ref_per_token_logps = get_per_token_logps(ref_model, prompt_completion_ids)
            if mistake == "old":
                old_per_token_logps = get_per_token_logps(model, prompt_completion_ids)
            else:
                with torch.no_grad():
                    old_per_token_logps = get_per_token_logps(model, prompt_completion_ids)
            rewards = (prompt_completion_ids[:, -NEW:] == 2).float().sum(-1)
            mean_grouped_rewards = rewards.view(-1, num_generations).mean(dim=1)
            std_grouped_rewards = rewards.view(-1, num_generations).std(dim=1)
            mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
            std_grouped_rewards = std_grouped_rewards.repeat_interleave(num_generations, dim=0)
            advantages = (rewards - mean_grouped_rewards) / (std_grouped_rewards + 1e-4)
            _buffered_inputs = {"prompt_completion_ids": prompt_completion_ids,
                                "old_per_token_logps": old_per_token_logps,
                                "ref_per_token_logps": ref_per_token_logps, "advantages": advantages}
        inputs = _buffered_inputs
        per_token_logps = get_per_token_logps(model, inputs["prompt_completion_ids"])
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        coef_1 = torch.exp(per_token_logps - inputs["old_per_token_logps"])
        coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
        per_token_loss1 = coef_1 * inputs["advantages"].unsqueeze(1)
        per_token_loss2 = coef_2 * inputs["advantages"].unsqueeze(1)
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2) + beta * per_token_kl
        loss = per_token_loss.mean()
        guard.backward(loss) if guard else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def simple_grpo(check: str | None) -> list[torch.Tensor]:
    """lsdefine/simple_GRPO without generated log-probabilities: each batch (generated, its reference log-probabilities
    computed under no_grad by the reference server) is used for one update, the ratio taken to the detached current
    log-probabilities."""
    torch.manual_seed(0)
    model = CausalLM()
    ref_model = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = GraphGuard(model, optimizer, check=check) if check else None
    beta, num = 0.04, 4
    for _ in range(4):
        inputs, _ = generate(model, torch.randint(0, VOCAB, (1, PROMPT)).repeat(num, 1))
        rewards = (inputs[:, PROMPT:] == 2).float().sum(-1)
        rewards = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        with torch.no_grad():
            refs = get_per_token_logps(ref_model, inputs)
        advantages = rewards.unsqueeze(1)
        per_token_logps = get_per_token_logps(model, inputs)
        per_token_kl = torch.exp(refs - per_token_logps) - (refs - per_token_logps) - 1
        per_token_loss = torch.exp(per_token_logps - per_token_logps.detach()) * advantages
        per_token_loss = -(per_token_loss - beta * per_token_kl)
        loss = per_token_loss.mean(dim=1).mean()
        guard.backward(loss) if guard else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("check", MODES)
def test_grpo_with_buffered_inputs_is_quiet_and_bit_identical(check):
    assert same(quietly(grpo, check), bare(grpo))


@pytest.mark.parametrize("check", MODES)
def test_simple_grpo_ratio_to_detached_log_probs_is_quiet_and_bit_identical(check):
    assert same(quietly(simple_grpo, check), bare(simple_grpo))


# PPO (trl's PPOv2: PolicyAndValueWrapper, a value model, a frozen reference policy and reward model)

class ScoreModel(nn.Module):
    base_model_prefix = "model"

    def __init__(self):
        super().__init__()
        self.model, self.score = Backbone(), nn.Linear(DIM, 1)


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


def get_reward(model, query_responses):
    reward_logits = model.score(getattr(model, model.base_model_prefix)(query_responses))
    return reward_logits, reward_logits[:, -1].squeeze(-1)


def masked_whiten(values):
    mean, var = values.mean(), values.var()
    return (values - mean) * torch.rsqrt(var + 1e-8)


def ppo(check: str | None, mistake: str = "", shared_trunk: bool = False) -> list[torch.Tensor]:
    """Three rollouts of four queries, two PPO epochs of two minibatches; the rollout's log-probabilities taken by a
    forward pass over the completions (as trl's PPOTrainer before PPOv2 did, and OpenRLHF does), not from the logits
    of generation. ``shared_trunk``: the value model's backbone is the policy's (a value head on the policy's trunk).
    ``mistake``: ``"rollout"``, the rollout outside ``torch.no_grad()``; ``"stats"``, the statistics written outside
    it."""
    torch.manual_seed(0)
    np.random.seed(0)
    kl_coef, gamma, lam, cliprange, cliprange_value, vf_coef = 0.05, 1.0, 0.95, 0.2, 0.2, 0.1
    policy, value_model, reward_model = CausalLM(), ScoreModel(), ScoreModel()
    if shared_trunk:
        value_model.model = policy.model
    ref_policy = copy.deepcopy(policy)
    for module in [ref_policy, reward_model]:
        module.requires_grad_(False)
    model = PolicyAndValueWrapper(policy, value_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-5)
    guard = GraphGuard(model, optimizer, check=check) if check else None
    local_batch_size, local_mini_batch_size, num_ppo_epochs = 4, 2, 2
    approxkl_stats, pg_loss_stats = torch.zeros(num_ppo_epochs, 2), torch.zeros(num_ppo_epochs, 2)
    for _ in range(3):
        with torch.set_grad_enabled(mistake == "rollout"):
            queries = torch.randint(0, VOCAB, (local_batch_size, PROMPT))
            query_responses, _ = generate(model.policy, queries, TEMPERATURE)
            responses = query_responses[:, PROMPT:]
            logits = model.policy(query_responses)[:, PROMPT - 1: -1] / (TEMPERATURE + 1e-7)
            logprobs = torch.gather(F.log_softmax(logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)
            ref_logits = ref_policy(query_responses)[:, PROMPT - 1: -1]
            ref_logits /= TEMPERATURE + 1e-7
            ref_logprobs = torch.gather(F.log_softmax(ref_logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)
            full_value, _ = get_reward(model.value_model, query_responses)
            values = full_value[:, PROMPT - 1: -1].squeeze(-1)
            _, scores = get_reward(reward_model, query_responses)
            kl = logprobs - ref_logprobs
            rewards = (-kl_coef * kl).clone()
            rewards[:, -1] += scores
            lastgaelam, advantages_reversed = 0, []
            for t in reversed(range(NEW)):
                nextvalues = values[:, t + 1] if t < NEW - 1 else 0.0
                delta = rewards[:, t] + gamma * nextvalues - values[:, t]
                lastgaelam = delta + gamma * lam * lastgaelam
                advantages_reversed.append(lastgaelam)
            advantages = torch.stack(advantages_reversed[::-1], axis=1)
            returns = advantages + values
            advantages = masked_whiten(advantages)
        for ppo_epoch_idx in range(num_ppo_epochs):
            b_inds = np.random.permutation(local_batch_size)
            for minibatch_idx, start in enumerate(range(0, local_batch_size, local_mini_batch_size)):
                mb_inds = b_inds[start:start + local_mini_batch_size]
                mb_advantage, mb_responses, mb_return = advantages[mb_inds], responses[mb_inds], returns[mb_inds]
                mb_logprobs, mb_values = logprobs[mb_inds], values[mb_inds]
                output, vpred_temp = model(query_responses[mb_inds])
                logits = output[:, PROMPT - 1: -1]
                logits /= TEMPERATURE + 1e-7
                new_logprobs = torch.gather(F.log_softmax(logits, dim=-1), 2, mb_responses.unsqueeze(-1)).squeeze(-1)
                vpred = vpred_temp[:, PROMPT - 1: -1].squeeze(-1)
                vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
                vf_loss = 0.5 * torch.max(torch.square(vpred - mb_return), torch.square(vpredclipped - mb_return)).mean()
                logprobs_diff = new_logprobs - mb_logprobs
                ratio = torch.exp(logprobs_diff)
                pg_losses = -mb_advantage * ratio
                pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
                pg_loss = torch.max(pg_losses, pg_losses2).mean()
                loss = pg_loss + vf_coef * vf_loss
                guard.backward(loss) if guard else loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                with torch.set_grad_enabled(mistake == "stats"):
                    approxkl = 0.5 * (logprobs_diff ** 2).mean()
                    approxkl_stats[ppo_epoch_idx, minibatch_idx] = approxkl
                    pg_loss_stats[ppo_epoch_idx, minibatch_idx] = pg_loss
    return [p.detach().clone() for p in model.parameters()]


# RLOO (trl's RLOOTrainer before its rewrite)

def rloo(check: str | None, mistake: str = "") -> list[torch.Tensor]:
    """Three rollouts of four queries, each repeated rloo_k=2 times, two PPO epochs of two minibatches; the rollout's
    log-probabilities taken by a forward pass, as in ``ppo``. ``mistake``: ``"rollout"``, the rollout outside
    ``torch.no_grad()``; ``"kept"``, each minibatch's new log-probabilities appended to a list kept across updates
    (``"kept_detached"``: appended detached)."""
    torch.manual_seed(0)
    np.random.seed(0)
    rloo_k, kl_coef, cliprange = 2, 0.05, 0.2
    model, reward_model = CausalLM(), ScoreModel()
    ref_policy = copy.deepcopy(model)
    for module in [ref_policy, reward_model]:
        module.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-5)
    guard = GraphGuard(model, optimizer, check=check) if check else None
    local_batch_size, local_mini_batch_size, num_ppo_epochs = 4 * rloo_k, 4, 2
    all_new_logprobs = []
    for _ in range(3):
        with torch.set_grad_enabled(mistake == "rollout"):
            queries = torch.randint(0, VOCAB, (local_batch_size // rloo_k, PROMPT)).repeat(rloo_k, 1)
            query_responses, _ = generate(model, queries, TEMPERATURE)
            responses = query_responses[:, PROMPT:]
            logits = model(query_responses)[:, PROMPT - 1: -1] / (TEMPERATURE + 1e-7)
            logprobs = torch.gather(F.log_softmax(logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)
            ref_logits = ref_policy(query_responses)[:, PROMPT - 1: -1]
            ref_logits /= TEMPERATURE + 1e-7
            ref_logprobs = torch.gather(F.log_softmax(ref_logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)
            _, scores = get_reward(reward_model, query_responses)
            kl = logprobs - ref_logprobs
            rlhf_reward = (scores + (-kl_coef * kl).sum(1)).reshape(rloo_k, -1)
            baseline = (rlhf_reward.sum(0) - rlhf_reward) / (rloo_k - 1)
            advantages = (rlhf_reward - baseline).flatten()
        for _ in range(num_ppo_epochs):
            b_inds = np.random.permutation(local_batch_size)
            for start in range(0, local_batch_size, local_mini_batch_size):
                mb_inds = b_inds[start:start + local_mini_batch_size]
                mb_advantage, mb_responses, mb_logprobs = advantages[mb_inds], responses[mb_inds], logprobs[mb_inds]
                logits = model(query_responses[mb_inds])[:, PROMPT - 1: -1]
                logits /= TEMPERATURE + 1e-7
                new_logprobs = torch.gather(F.log_softmax(logits, dim=-1), 2, mb_responses.unsqueeze(-1)).squeeze(-1)
                new_logprobs = new_logprobs.sum(1)
                if mistake == "kept":
                    all_new_logprobs.append(new_logprobs)
                elif mistake == "kept_detached":
                    all_new_logprobs.append(new_logprobs.detach())
                mb_logprobs = mb_logprobs.sum(1)
                ratio = torch.exp(new_logprobs - mb_logprobs)
                pg_losses = -mb_advantage * ratio
                pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
                loss = torch.max(pg_losses, pg_losses2).mean()
                guard.backward(loss) if guard else loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("check", MODES)
def test_ppo_with_a_value_model_is_quiet_and_bit_identical(check):
    assert same(quietly(ppo, check), bare(ppo))


@pytest.mark.parametrize("check", MODES)
def test_ppo_with_the_value_head_on_the_policy_trunk_is_quiet_and_bit_identical(check):
    assert same(quietly(ppo, check, shared_trunk=True), bare(ppo, "", True))


@pytest.mark.parametrize("check", MODES)
def test_rloo_is_quiet_and_bit_identical(check):
    assert same(quietly(rloo, check), bare(rloo))


# The mistakes. A rollout's value kept with its graph for several updates is a target the loss compares with: computed
# under torch.no_grad() (the loops above), not a carried state to detach at the end of each step, whose fix would
# leave the buffered inputs (or the advantages made from it) holding the graph.

TARGET = r"To fix: if it is a target the loss compares with.*compute it under `torch.no_grad\(\)`"


@pytest.mark.parametrize("check", MODES)
def test_grpo_old_log_probs_with_their_graph_for_num_iterations_are_told_as_a_target(check):
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `local old_per_token_logps`; an "
                       r"earlier backward already freed the saved tensors of its graph.*" + TARGET):
        grpo(check, "old")


@pytest.mark.parametrize("check", MODES)
def test_grpo_reference_model_that_is_the_policy_frozen_says_they_are_one_module(check):
    with pytest.raises(NoGraphError, match=r"\(step 1, loss 'loss'\).*`model` and `ref_model` are one module, not "
                       r"copies.*To fix: .*`ref_model = copy.deepcopy\(model\)`, then freeze it"):
        grpo(check, "ref_is_policy")


@pytest.mark.parametrize("check", MODES)
def test_ppo_rollout_outside_no_grad_names_the_returns_as_a_target(check):
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `local returns`.*" + TARGET):
        ppo(check, "rollout")


@pytest.mark.parametrize("check", MODES)
def test_rloo_rollout_outside_no_grad_names_the_log_probs_as_a_target(check):
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `local logprobs`.*" + TARGET):
        rloo(check, "rollout")


@pytest.mark.parametrize("check", ["always", "auto"])
def test_ppo_statistics_written_outside_no_grad_name_each_tensor_written_so(check):
    with pytest.warns(GraphLeakWarning, match=r"held by `local approxkl_stats`.*values were written into its slots.*"
                      r"To fix: detach what is written into `approxkl_stats`.*or write it under `torch.no_grad\(\)`.*"
                      r"\(and alike for `pg_loss_stats`, written so beside it\)"):
        ppo(check, "stats")


@pytest.mark.parametrize("check", ["always", "auto"])
def test_rloo_new_log_probs_kept_in_a_list_across_updates_are_told_to_be_detached_where_added(check):
    with pytest.warns(GraphLeakWarning, match=r"held by `local all_new_logprobs\[0\]`.*one more in `all_new_logprobs` "
                      r"every step. To fix: detach what is added to `all_new_logprobs` where it is added "
                      r"\(`all_new_logprobs.append\(x.detach\(\)\)`"):
        rloo(check, "kept")
    assert same(quietly(rloo, check, "kept_detached"), bare(rloo))
