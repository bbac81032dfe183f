"""PPO (vwxyzjn/cleanrl, cleanrl/ppo.py).

What it exercises: rollouts played under ``no_grad`` into preallocated storage written in place, GAE,
several epochs of shuffled minibatches over each rollout (NumPy's global RNG), the learning rate annealed by
assigning ``optimizer.param_groups[0]["lr"]`` before every rollout, value clipping against the stored values,
gradient clipping, and the epochs cut short when the approximate KL passes ``target_kl``. In the port the data
iterator plays the rollouts with the current agent and anneals the rate; the step's KL reaches it through an
attribute.

Changes for a seconds-long test: a deterministic 2-environment stand-in for gym's vector env (auto-reset
after 5 steps), 8 steps per rollout, 2 minibatches, 3 epochs, 2 updates, hidden size 8.
"""
import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions.categorical import Categorical

from safeloop import Trainer

from .harness import checks, compare

NUM_ENVS, NUM_STEPS, NUM_MINIBATCHES, UPDATE_EPOCHS, NUM_UPDATES = 2, 8, 2, 3, 2
BATCH_SIZE = NUM_ENVS * NUM_STEPS
MINIBATCH_SIZE = BATCH_SIZE // NUM_MINIBATCHES
LEARNING_RATE, GAMMA, GAE_LAMBDA, CLIP_COEF, ENT_COEF, VF_COEF, MAX_GRAD_NORM = 0.05, 0.99, 0.95, 0.2, 0.01, 0.5, 0.5
TARGET_KL = 0.002


class VecEnv:
    """Two deterministic CartPole-sized environments: 4-d observations, two actions, reward 1 - |x|,
    each reset to a new start after 5 steps (gym's vector envs reset by themselves)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        self.a, self.b = torch.randn(4, 4, generator=gen) / 2, torch.randn(4, generator=gen)
        self.starts = torch.Generator().manual_seed(8)

    def reset(self):
        self.t = torch.zeros(NUM_ENVS)
        self.state = torch.randn(NUM_ENVS, 4, generator=self.starts)
        return self.state.clone()

    def step(self, action):
        self.state = torch.tanh(self.state @ self.a + (action.float() - 0.5).unsqueeze(1) * self.b)
        reward = 1.0 - self.state[:, 0].abs()
        self.t += 1
        done = self.t >= 5
        if done.any():
            self.state[done] = torch.randn(int(done.sum()), 4, generator=self.starts)
            self.t[done] = 0
        return self.state.clone(), reward, done.float()


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(4, 8)), nn.Tanh(), layer_init(nn.Linear(8, 8)), nn.Tanh(),
                                    layer_init(nn.Linear(8, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(4, 8)), nn.Tanh(), layer_init(nn.Linear(8, 8)), nn.Tanh(),
                                   layer_init(nn.Linear(8, 2), std=0.01))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class Rollout:
    """The source's storage, rollout and GAE, one update's worth."""

    def __init__(self, envs):
        self.envs = envs
        self.obs = torch.zeros((NUM_STEPS, NUM_ENVS, 4))
        self.actions = torch.zeros((NUM_STEPS, NUM_ENVS))
        self.logprobs = torch.zeros((NUM_STEPS, NUM_ENVS))
        self.rewards = torch.zeros((NUM_STEPS, NUM_ENVS))
        self.dones = torch.zeros((NUM_STEPS, NUM_ENVS))
        self.values = torch.zeros((NUM_STEPS, NUM_ENVS))
        self.next_obs = envs.reset()
        self.next_done = torch.zeros(NUM_ENVS)

    def play(self, agent):
        obs, actions, logprobs, rewards, dones, values = (self.obs, self.actions, self.logprobs, self.rewards,
                                                          self.dones, self.values)
        for step in range(0, NUM_STEPS):
            obs[step] = self.next_obs
            dones[step] = self.next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(self.next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            self.next_obs, rewards[step], self.next_done = self.envs.step(action)

        with torch.no_grad():
            next_value = agent.get_value(self.next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(NUM_STEPS)):
                if t == NUM_STEPS - 1:
                    nextnonterminal = 1.0 - self.next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + GAMMA * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + GAMMA * GAE_LAMBDA * nextnonterminal * lastgaelam
            returns = advantages + values
        return (obs.reshape((-1, 4)), logprobs.reshape(-1), actions.reshape(-1), advantages.reshape(-1),
                returns.reshape(-1), values.reshape(-1))


def ppo_loss(agent, batch, mb_inds):
    """The minibatch's loss and approximate KL, as the source computes them (norm_adv, clip_vloss)."""
    b_obs, b_logprobs, b_actions, b_advantages, b_returns, b_values = batch
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
    logratio = newlogprob - b_logprobs[mb_inds]
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()

    mb_advantages = b_advantages[mb_inds]
    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - CLIP_COEF, 1 + CLIP_COEF)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    newvalue = newvalue.view(-1)
    v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
    v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds], -CLIP_COEF, CLIP_COEF)
    v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
    v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()

    entropy_loss = entropy.mean()
    return pg_loss - ENT_COEF * entropy_loss + v_loss * VF_COEF, approx_kl


def anneal(optimizer, update):
    frac = 1.0 - (update - 1.0) / NUM_UPDATES
    optimizer.param_groups[0]["lr"] = frac * LEARNING_RATE


def ppo_hand(agent, data):
    """The source's update loop (``data``: the port's iterator, for its environments only)."""
    np.random.seed(0)
    optimizer = torch.optim.Adam(agent.parameters(), lr=LEARNING_RATE, eps=1e-5)
    rollout = Rollout(data.envs)
    steps = 0
    for update in range(1, NUM_UPDATES + 1):
        anneal(optimizer, update)
        batch = rollout.play(agent)
        b_inds = np.arange(BATCH_SIZE)
        for epoch in range(UPDATE_EPOCHS):
            np.random.shuffle(b_inds)
            for start in range(0, BATCH_SIZE, MINIBATCH_SIZE):
                loss, approx_kl = ppo_loss(agent, batch, b_inds[start:start + MINIBATCH_SIZE])
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), MAX_GRAD_NORM)
                optimizer.step()
                steps += 1
            if TARGET_KL is not None and approx_kl > TARGET_KL:
                break
    return steps


class Minibatches:
    """The update loop around the minibatches: each update anneals the rate, plays a rollout with the current
    agent, then yields its shuffled minibatches epoch by epoch, stopping the epochs early on the step's KL."""

    def __init__(self, agent):
        self.agent, self.envs = agent, VecEnv()
        self.optimizer, self.approx_kl = None, None  # set by the Trainer (on_fit_start) and by each step

    def __iter__(self):
        np.random.seed(0)
        rollout = Rollout(self.envs)
        for update in range(1, NUM_UPDATES + 1):
            anneal(self.optimizer, update)
            batch = rollout.play(self.agent)
            b_inds = np.arange(BATCH_SIZE)
            for epoch in range(UPDATE_EPOCHS):
                np.random.shuffle(b_inds)
                for start in range(0, BATCH_SIZE, MINIBATCH_SIZE):
                    yield batch, b_inds[start:start + MINIBATCH_SIZE]
                if TARGET_KL is not None and self.approx_kl > TARGET_KL:
                    break


class PPO(Trainer):
    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=LEARNING_RATE, eps=1e-5)

    def on_fit_start(self):
        self.train_data.optimizer = self.optimizers["optimizer"]

    def training_step(self, minibatch):
        loss, self.train_data.approx_kl = ppo_loss(self.model, *minibatch)
        return loss


def steps_taken() -> int:
    """How many minibatch updates the hand-written loop makes (the KL cuts epochs short), from compare's seeds."""
    torch.manual_seed(0)
    agent = Agent()
    torch.manual_seed(1)
    return ppo_hand(agent, Minibatches(agent))


@pytest.mark.parametrize("check", checks())
def test_ppo_with_rollouts_played_by_the_data_iterator(check):
    steps = steps_taken()
    assert steps < NUM_UPDATES * UPDATE_EPOCHS * NUM_MINIBATCHES  # the KL did cut an update's epochs short
    compare(Agent, ppo_hand, PPO, Minibatches, check, steps=steps, grad_clip=MAX_GRAD_NORM, max_epochs=1)
