"""Reinforcement learning: episodes played inside the step or by the data iterator, soft actor-critic's
three optimizers and one-step-lagged temperature, a Lagrange multiplier with its own optimizer, DQN's
replay memory and soft-updated target network."""
import math
import random
from collections import deque, namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical, Normal

from safeloop import Trainer

from .harness import batches, checks, compare, fixed

GAMMA = 0.99
EPS = torch.finfo(torch.float32).eps


class Env:
    """A CartPole-sized stand-in, deterministic: 4-d state, two actions, reward 1 - |x|, 5 steps."""

    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        self.a, self.b = torch.randn(4, 4, generator=gen) / 2, torch.randn(4, generator=gen)

    def reset(self, state):
        self.state, self.t = state, 0
        return state

    def step(self, action):
        self.state, self.t = torch.tanh(self.state @ self.a + (action - 0.5) * self.b), self.t + 1
        return self.state, 1.0 - abs(float(self.state[0])), self.t >= 5, {}


def starts(n):
    return batches(n, (4,), seed=5)


# -- actor-critic: pytorch/examples, reinforcement_learning/actor_critic.py -------------------------------
SavedAction = namedtuple("SavedAction", ["log_prob", "value"])


class ActorCriticPolicy(nn.Module):
    """Actor and critic in one model; the episode's actions and rewards are kept on it, as in the source."""

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 8)
        self.action_head = nn.Linear(8, 2)
        self.value_head = nn.Linear(8, 1)
        self.saved_actions = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.affine1(x))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


def select_action(model, state):
    probs, state_value = model(state)
    m = Categorical(probs)
    action = m.sample()
    model.saved_actions.append(SavedAction(m.log_prob(action), state_value))
    return action.item()


def play_actor_critic(model, env, state):
    state = env.reset(state)
    for t in range(1, 10000):
        action = select_action(model, state)
        state, reward, done, _ = env.step(action)
        model.rewards.append(reward)
        if done:
            break


def actor_critic_loss(model):
    R = 0
    policy_losses, value_losses, returns = [], [], []
    for r in model.rewards[::-1]:
        R = r + GAMMA * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + EPS)
    for (log_prob, value), R in zip(model.saved_actions, returns):
        advantage = R - value.item()
        policy_losses.append(-log_prob * advantage)
        value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
    return torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()


def actor_critic_hand(model, data):
    env, optimizer = Env(), torch.optim.Adam(model.parameters(), lr=3e-2)
    for state in data:
        play_actor_critic(model, env, state)
        optimizer.zero_grad()
        loss = actor_critic_loss(model)
        loss.backward()
        optimizer.step()
        del model.rewards[:]
        del model.saved_actions[:]


class ActorCritic(Trainer):
    """The episode is played inside the step (the batch is its first state)."""

    env = Env()

    def training_step(self, state):
        play_actor_critic(self.model, self.env, state)
        loss = actor_critic_loss(self.model)
        del self.model.rewards[:]
        del self.model.saved_actions[:]
        return loss


@pytest.mark.parametrize("check", checks())
def test_actor_critic(check):
    compare(ActorCriticPolicy, actor_critic_hand, ActorCritic, fixed(starts(5)), check, steps=5,
            optimizer=lambda p: torch.optim.Adam(p, lr=3e-2))


# -- REINFORCE, the episode played by the data iterator: pytorch/examples, reinforcement_learning/reinforce.py
class ReinforcePolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 8)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(8, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=1)


def play_reinforce(policy, env, state):
    state = env.reset(state)
    for t in range(1, 10000):
        probs = policy(state.unsqueeze(0))
        m = Categorical(probs)
        action = m.sample()
        policy.saved_log_probs.append(m.log_prob(action))
        state, reward, done, _ = env.step(action.item())
        policy.rewards.append(reward)
        if done:
            break


def reinforce_loss(saved_log_probs, rewards):
    R, policy_loss, returns = 0, [], []
    for r in rewards[::-1]:
        R = r + GAMMA * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + EPS)
    for log_prob, R in zip(saved_log_probs, returns):
        policy_loss.append(-log_prob * R)
    return torch.cat(policy_loss).sum()


def reinforce_hand(policy, episodes):
    env, optimizer = Env(), torch.optim.Adam(policy.parameters(), lr=1e-2)
    for state in episodes.states:  # the source's main loop plays the episode, then updates
        play_reinforce(policy, env, state)
        optimizer.zero_grad()
        policy_loss = reinforce_loss(policy.saved_log_probs, policy.rewards)
        policy_loss.backward()
        optimizer.step()
        del policy.rewards[:]
        del policy.saved_log_probs[:]


class Episodes:
    """The data iterator plays each episode with the current policy (log-probabilities with their graph)."""

    def __init__(self, policy, states):
        self.policy, self.states, self.env = policy, states, Env()

    def __iter__(self):
        for state in self.states:
            play_reinforce(self.policy, self.env, state)
            episode = (self.policy.saved_log_probs[:], self.policy.rewards[:])
            del self.policy.rewards[:]
            del self.policy.saved_log_probs[:]
            yield episode


class Reinforce(Trainer):
    def training_step(self, episode):
        return reinforce_loss(*episode)


@pytest.mark.parametrize("check", checks())
def test_reinforce_with_episodes_played_by_the_data_iterator(check):
    compare(ReinforcePolicy, reinforce_hand, Reinforce, lambda policy: Episodes(policy, starts(5)), check, steps=5,
            optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))


# -- soft actor-critic: pranz24/pytorch-soft-actor-critic, sac.py (update_parameters), model.py, utils.py --
LOG_SIG_MAX, LOG_SIG_MIN, SAC_EPS = 2, -20, 1e-6
TAU, TARGET_ENTROPY, ALPHA, LR = 0.005, -1.0, 0.2, 3e-3


class QNetwork(nn.Module):
    def __init__(self, num_inputs, num_actions, hidden_dim):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(num_inputs + num_actions, hidden_dim), nn.Linear(hidden_dim, hidden_dim)
        self.linear3 = nn.Linear(hidden_dim, 1)
        self.linear4, self.linear5 = nn.Linear(num_inputs + num_actions, hidden_dim), nn.Linear(hidden_dim, hidden_dim)
        self.linear6 = nn.Linear(hidden_dim, 1)

    def forward(self, state, action):
        xu = torch.cat([state, action], 1)
        x1 = self.linear3(F.relu(self.linear2(F.relu(self.linear1(xu)))))
        x2 = self.linear6(F.relu(self.linear5(F.relu(self.linear4(xu)))))
        return x1, x2


class GaussianPolicy(nn.Module):
    def __init__(self, num_inputs, num_actions, hidden_dim):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(num_inputs, hidden_dim), nn.Linear(hidden_dim, hidden_dim)
        self.mean_linear, self.log_std_linear = nn.Linear(hidden_dim, num_actions), nn.Linear(hidden_dim, num_actions)
        self.action_scale, self.action_bias = torch.tensor(1.0), torch.tensor(0.0)

    def forward(self, state):
        x = F.relu(self.linear2(F.relu(self.linear1(state))))
        return self.mean_linear(x), torch.clamp(self.log_std_linear(x), min=LOG_SIG_MIN, max=LOG_SIG_MAX)

    def sample(self, state):
        mean, log_std = self.forward(state)
        normal = Normal(mean, log_std.exp())
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + SAC_EPS)  # enforcing the action bound
        log_prob = log_prob.sum(1, keepdim=True)
        return action, log_prob, torch.tanh(mean) * self.action_scale + self.action_bias


def sac_agent():
    model = nn.Module()
    model.critic, model.critic_target = QNetwork(3, 1, 8), QNetwork(3, 1, 8)
    model.critic_target.load_state_dict(model.critic.state_dict())  # hard_update
    model.policy = GaussianPolicy(3, 1, 8)
    model.log_alpha = nn.Parameter(torch.zeros(1))
    return model


def soft_update(target, source, tau):
    for target_param, param in zip(target.parameters(), source.parameters()):
        target_param.data.copy_(target_param.data * (1.0 - tau) + param.data * tau)


def sac_target(model, alpha, batch):
    state_batch, action_batch, reward_batch, next_state_batch, mask_batch = batch
    with torch.no_grad():
        next_state_action, next_state_log_pi, _ = model.policy.sample(next_state_batch)
        qf1_next_target, qf2_next_target = model.critic_target(next_state_batch, next_state_action)
        min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
        return reward_batch + mask_batch * GAMMA * min_qf_next_target


def sac_optimizers(model):
    return {"critic": torch.optim.Adam(model.critic.parameters(), lr=LR),
            "policy": torch.optim.Adam(model.policy.parameters(), lr=LR),
            "alpha": torch.optim.Adam([model.log_alpha], lr=LR)}


def sac_hand(model, data):
    opts = sac_optimizers(model)
    critic_optim, policy_optim, alpha_optim = opts["critic"], opts["policy"], opts["alpha"]
    alpha = ALPHA
    for batch in data:
        next_q_value = sac_target(model, alpha, batch)
        qf1, qf2 = model.critic(batch[0], batch[1])
        qf1_loss, qf2_loss = F.mse_loss(qf1, next_q_value), F.mse_loss(qf2, next_q_value)
        critic_optim.zero_grad()
        qf1_loss.backward()
        critic_optim.step()
        critic_optim.zero_grad()
        qf2_loss.backward()  # built before the critic's step, through weights that step did not change
        critic_optim.step()

        pi, log_pi, _ = model.policy.sample(batch[0])
        qf1_pi, qf2_pi = model.critic(batch[0], pi)
        policy_loss = ((alpha * log_pi) - torch.min(qf1_pi, qf2_pi)).mean()
        policy_optim.zero_grad()
        policy_loss.backward()
        policy_optim.step()

        alpha_loss = -(model.log_alpha * (log_pi + TARGET_ENTROPY).detach()).mean()
        alpha_optim.zero_grad()
        alpha_loss.backward()
        alpha_optim.step()
        alpha = model.log_alpha.exp()  # with its graph: the next update's policy loss back-propagates into it
        soft_update(model.critic_target, model.critic, TAU)


class SAC(Trainer):
    automatic = False
    alpha = ALPHA

    def configure_optimizers(self):
        return sac_optimizers(self.model)

    def training_step(self, batch):
        m = self.model
        next_q_value = sac_target(m, self.alpha, batch)
        qf1, qf2 = m.critic(batch[0], batch[1])
        qf1_loss, qf2_loss = F.mse_loss(qf1, next_q_value), F.mse_loss(qf2, next_q_value)
        self.backward(qf1_loss, optimizer="critic")
        self.step("critic")
        self.backward(qf2_loss, optimizer="critic")
        self.step("critic")
        pi, log_pi, _ = m.policy.sample(batch[0])
        qf1_pi, qf2_pi = m.critic(batch[0], pi)
        policy_loss = ((self.alpha * log_pi) - torch.min(qf1_pi, qf2_pi)).mean()
        self.backward(policy_loss, optimizer="policy")
        self.step("policy")
        alpha_loss = -(m.log_alpha * (log_pi + TARGET_ENTROPY).detach()).mean()
        self.backward(alpha_loss, optimizer="alpha")
        self.step("alpha")
        self.alpha = m.log_alpha.exp()
        soft_update(m.critic_target, m.critic, TAU)
        return {"critic": qf1_loss + qf2_loss, "policy": policy_loss, "alpha": alpha_loss}


def replay(n):
    """Replay-memory samples: (state, action, reward, next_state, mask)."""
    return [(s, a.tanh(), r, s2, (m > -1).float()) for s, a, r, s2, m in batches(n, (8, 3), (8, 1), (8, 1), (8, 3),
                                                                                   (8, 1), seed=6)]


@pytest.mark.parametrize("check", checks())
def test_soft_actor_critic(check):
    compare(sac_agent, sac_hand, SAC, fixed(replay(5)), check, steps=5)


# -- a Lagrange multiplier with its own optimizer: PKU-Alignment/omnisafe, omnisafe/common/lagrange.py
#    (update_lagrange_multiplier) and algorithms/on_policy/naive_lagrange/ppo_lag.py (penalty = lambda.item())
COST_LIMIT, CLIP = 0.5, 0.2


def lagrangian_agent():
    model = nn.Module()
    model.actor = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model.lagrangian_multiplier = nn.Parameter(torch.as_tensor(max(0.1, 1e-5)))
    return model


def lagrangian_opts(model):
    return {"lambda": torch.optim.Adam([model.lagrangian_multiplier], lr=0.05),
            "actor": torch.optim.Adam(model.actor.parameters(), lr=0.01)}


def lambda_loss(model, mean_ep_cost):
    return -model.lagrangian_multiplier * (mean_ep_cost - COST_LIMIT)


def ppo_lag_loss(model, batch):
    obs, act, logp, adv_r, adv_c, _ = batch
    penalty = model.lagrangian_multiplier.item()
    adv = (adv_r - penalty * adv_c) / (1 + penalty)
    distribution = Categorical(logits=model.actor(obs))
    ratio = torch.exp(distribution.log_prob(act) - logp)
    loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv).mean()
    return loss - 0.01 * distribution.entropy().mean()


def lagrangian_hand(model, data):
    opts = lagrangian_opts(model)
    for batch in data:
        opts["lambda"].zero_grad()
        loss = lambda_loss(model, batch[-1])
        loss.backward()
        opts["lambda"].step()
        model.lagrangian_multiplier.data.clamp_(0, None)  # enforce: lambda in [0, inf]
        opts["actor"].zero_grad()
        ppo_lag_loss(model, batch).backward()
        opts["actor"].step()


class PPOLagrangian(Trainer):
    automatic = False

    def configure_optimizers(self):
        return lagrangian_opts(self.model)

    def training_step(self, batch):
        self.backward(lambda_loss(self.model, batch[-1]), optimizer="lambda")
        self.step("lambda")
        self.model.lagrangian_multiplier.data.clamp_(0, None)
        loss = ppo_lag_loss(self.model, batch)
        self.backward(loss, optimizer="actor")
        self.step("actor")
        return loss


def rollouts(n):
    """(obs, act, logp_old, adv_r, adv_c, mean episode cost as a float), as the logger hands them over."""
    gen = torch.Generator().manual_seed(8)
    return [(torch.randn(16, 4, generator=gen), torch.randint(2, (16,), generator=gen),
             -torch.rand(16, generator=gen), torch.randn(16, generator=gen), torch.randn(16, generator=gen),
             float(torch.rand((), generator=gen))) for _ in range(n)]


@pytest.mark.parametrize("check", checks())
def test_ppo_lagrangian(check):
    compare(lagrangian_agent, lagrangian_hand, PPOLagrangian, fixed(rollouts(5)), check, steps=5)


# -- DQN: pytorch/tutorials, intermediate_source/reinforcement_q_learning.py ---------------------------
Transition = namedtuple("Transition", ("state", "action", "next_state", "reward"))
BATCH_SIZE, DQN_GAMMA, EPS_START, EPS_END, EPS_DECAY, DQN_TAU, DQN_LR = 8, 0.99, 0.9, 0.05, 1000, 0.005, 1e-2


class ReplayMemory:
    def __init__(self, capacity, rng):
        self.memory, self.rng = deque([], maxlen=capacity), rng

    def push(self, *args):
        self.memory.append(Transition(*args))

    def sample(self, batch_size):
        return self.rng.sample(self.memory, batch_size)

    def __len__(self):
        return len(self.memory)


class DQN(nn.Module):
    def __init__(self, n_observations=4, n_actions=2):
        super().__init__()
        self.layer1, self.layer2, self.layer3 = nn.Linear(n_observations, 16), nn.Linear(16, 16), nn.Linear(16, n_actions)

    def forward(self, x):
        return self.layer3(F.relu(self.layer2(F.relu(self.layer1(x)))))


def dqn_agent():
    """The policy network and its target (parameters that take no gradient and no optimizer) in one module."""
    agent = nn.Module()
    agent.policy_net, agent.target_net = DQN(), DQN()
    agent.target_net.load_state_dict(agent.policy_net.state_dict())
    return agent


def soft_update_target(agent):
    target_net_state_dict = agent.target_net.state_dict()
    policy_net_state_dict = agent.policy_net.state_dict()
    for key in policy_net_state_dict:
        target_net_state_dict[key] = policy_net_state_dict[key] * DQN_TAU + target_net_state_dict[key] * (1 - DQN_TAU)
    agent.target_net.load_state_dict(target_net_state_dict)


class Play:
    """The tutorial's main loop around ``optimize_model``: an epsilon-greedy step of the environment (with
    the current policy, under ``no_grad``), the transition pushed to the replay memory; then a sample of it,
    for the consumer to optimize on and soft-update the target after. Until the memory holds a batch,
    ``optimize_model`` returns at once and only the soft update runs."""

    def __init__(self, agent, states):
        self.agent, self.states, self.env = agent, states, Env()
        self.rng = random.Random(3)
        self.memory, self.steps_done = ReplayMemory(100, self.rng), 0

    def select_action(self, state):
        sample = self.rng.random()
        eps_threshold = EPS_END + (EPS_START - EPS_END) * math.exp(-1. * self.steps_done / EPS_DECAY)
        self.steps_done += 1
        if sample > eps_threshold:
            with torch.no_grad():
                return self.agent.policy_net(state).max(1).indices.view(1, 1)
        return torch.tensor([[self.rng.randrange(2)]], dtype=torch.long)

    def __iter__(self):
        for start in self.states:
            state = self.env.reset(start).unsqueeze(0)
            while True:
                action = self.select_action(state)
                observation, reward, terminated, _ = self.env.step(action.item())
                reward = torch.tensor([reward])
                next_state = None if terminated else observation.unsqueeze(0)
                self.memory.push(state, action, next_state, reward)
                state = next_state
                if len(self.memory) < BATCH_SIZE:
                    soft_update_target(self.agent)
                else:
                    yield self.memory.sample(BATCH_SIZE)
                if terminated:
                    break


def dqn_loss(agent, transitions):
    batch = Transition(*zip(*transitions))
    non_final_mask = torch.tensor(tuple(map(lambda s: s is not None, batch.next_state)), dtype=torch.bool)
    non_final_next_states = torch.cat([s for s in batch.next_state if s is not None])
    state_batch, action_batch, reward_batch = torch.cat(batch.state), torch.cat(batch.action), torch.cat(batch.reward)
    state_action_values = agent.policy_net(state_batch).gather(1, action_batch)
    next_state_values = torch.zeros(BATCH_SIZE)
    with torch.no_grad():
        next_state_values[non_final_mask] = agent.target_net(non_final_next_states).max(1).values
    expected_state_action_values = (next_state_values * DQN_GAMMA) + reward_batch
    criterion = nn.SmoothL1Loss()
    return criterion(state_action_values, expected_state_action_values.unsqueeze(1))


def dqn_optimizer(agent):
    return torch.optim.AdamW(agent.policy_net.parameters(), lr=DQN_LR, amsgrad=True)


def dqn_hand(agent, play, steps=6):
    optimizer = dqn_optimizer(agent)
    for _, transitions in zip(range(steps), play):
        loss = dqn_loss(agent, transitions)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_value_(agent.policy_net.parameters(), 100)
        optimizer.step()
        soft_update_target(agent)


class DQNTrainer(Trainer):
    def configure_optimizers(self):
        return dqn_optimizer(self.model)

    def training_step(self, transitions):
        return dqn_loss(self.model, transitions)

    def on_before_optimizer_step(self, name, optimizer):
        torch.nn.utils.clip_grad_value_(self.model.policy_net.parameters(), 100)

    def on_step_end(self, losses):
        soft_update_target(self.model)


@pytest.mark.parametrize("check", checks())
def test_dqn_with_a_replay_memory_and_a_soft_updated_target(check):
    compare(dqn_agent, dqn_hand, DQNTrainer, lambda agent: Play(agent, starts(5)), check, steps=6)
