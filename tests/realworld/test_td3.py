"""Twin delayed deep deterministic policy gradients (TD3): sfujim/TD3 at commit
34770ccdcb51df6f6c7d85c1ba7e40d71b940d16, TD3.py (``Actor``, ``Critic``, ``TD3``), utils.py (``ReplayBuffer``)
and main.py (the loop).

Per environment step, once ``start_timesteps`` random actions have filled the replay buffer: an action from
the actor (``select_action``: a forward *with* a graph, read through ``.data.numpy()``, the graph dropped) plus
NumPy's Gaussian exploration noise, the transition stored, then ``TD3.train``: a batch drawn with
``np.random.randint``, the target under ``no_grad`` from the target actor with clipped ``randn_like`` noise
(target policy smoothing) and the smaller of the target critic's twin heads, both heads regressed. Every
``policy_freq``-th call the actor's loss goes through the critic (leaving gradient on the critic's
parameters, which its next ``zero_grad`` clears), the actor steps, and both target networks are soft-updated
through ``target_param.data.copy_``. The target networks' parameters require grad and no optimizer holds them.

Changes for a seconds-long test: hidden layers of 16 (256), a batch of 8 (256), 4 random steps (25e3) and 6
training steps; a linear NumPy environment with 5-step episodes (gym's HalfCheetah); the nets built outside
``TD3`` and handed to it (so that the harness holds them); the evaluations and saves left out.

The port is manual, over ``critic`` and ``actor`` optimizers: the data iterator plays the environment with
the current actor and yields the sampled batch; ``training_step`` is ``TD3.train``'s body with
``self.backward``/``self.step``.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare

STATE_DIM, ACTION_DIM, MAX_ACTION, HIDDEN, BATCH = 3, 1, 2.0, 16, 8
START_TIMESTEPS, STEPS, EXPL_NOISE, MAX_EPISODE_STEPS = 4, 6, 0.1, 5
device = torch.device("cpu")


# -- TD3.py -------------------------------------------------------------------------------------------------
class Actor(nn.Module):
	def __init__(self, state_dim, action_dim, max_action):
		super(Actor, self).__init__()

		self.l1 = nn.Linear(state_dim, HIDDEN)
		self.l2 = nn.Linear(HIDDEN, HIDDEN)
		self.l3 = nn.Linear(HIDDEN, action_dim)

		self.max_action = max_action

	def forward(self, state):
		a = F.relu(self.l1(state))
		a = F.relu(self.l2(a))
		return self.max_action * torch.tanh(self.l3(a))


class Critic(nn.Module):
	def __init__(self, state_dim, action_dim):
		super(Critic, self).__init__()

		# Q1 architecture
		self.l1 = nn.Linear(state_dim + action_dim, HIDDEN)
		self.l2 = nn.Linear(HIDDEN, HIDDEN)
		self.l3 = nn.Linear(HIDDEN, 1)

		# Q2 architecture
		self.l4 = nn.Linear(state_dim + action_dim, HIDDEN)
		self.l5 = nn.Linear(HIDDEN, HIDDEN)
		self.l6 = nn.Linear(HIDDEN, 1)

	def forward(self, state, action):
		sa = torch.cat([state, action], 1)

		q1 = F.relu(self.l1(sa))
		q1 = F.relu(self.l2(q1))
		q1 = self.l3(q1)

		q2 = F.relu(self.l4(sa))
		q2 = F.relu(self.l5(q2))
		q2 = self.l6(q2)
		return q1, q2

	def Q1(self, state, action):
		sa = torch.cat([state, action], 1)

		q1 = F.relu(self.l1(sa))
		q1 = F.relu(self.l2(q1))
		q1 = self.l3(q1)
		return q1


class TD3(object):
	def __init__(self, nets, max_action, discount=0.99, tau=0.005, policy_noise=0.2, noise_clip=0.5,
				 policy_freq=2):
		self.actor = nets['actor']
		self.actor_target = nets['actor_target']
		self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=3e-4)

		self.critic = nets['critic']
		self.critic_target = nets['critic_target']
		self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=3e-4)

		self.max_action = max_action
		self.discount = discount
		self.tau = tau
		self.policy_noise = policy_noise
		self.noise_clip = noise_clip
		self.policy_freq = policy_freq

		self.total_it = 0

	def select_action(self, state):
		state = torch.FloatTensor(state.reshape(1, -1)).to(device)
		return self.actor(state).cpu().data.numpy().flatten()

	def train(self, replay_buffer, batch_size=256):
		self.total_it += 1

		# Sample replay buffer
		state, action, next_state, reward, not_done = replay_buffer.sample(batch_size)

		with torch.no_grad():
			# Select action according to policy and add clipped noise
			noise = (
				torch.randn_like(action) * self.policy_noise
			).clamp(-self.noise_clip, self.noise_clip)

			next_action = (
				self.actor_target(next_state) + noise
			).clamp(-self.max_action, self.max_action)

			# Compute the target Q value
			target_Q1, target_Q2 = self.critic_target(next_state, next_action)
			target_Q = torch.min(target_Q1, target_Q2)
			target_Q = reward + not_done * self.discount * target_Q

		# Get current Q estimates
		current_Q1, current_Q2 = self.critic(state, action)

		# Compute critic loss
		critic_loss = F.mse_loss(current_Q1, target_Q) + F.mse_loss(current_Q2, target_Q)

		# Optimize the critic
		self.critic_optimizer.zero_grad()
		critic_loss.backward()
		self.critic_optimizer.step()

		# Delayed policy updates
		if self.total_it % self.policy_freq == 0:

			# Compute actor losse
			actor_loss = -self.critic.Q1(state, self.actor(state)).mean()

			# Optimize the actor
			self.actor_optimizer.zero_grad()
			actor_loss.backward()
			self.actor_optimizer.step()

			# Update the frozen target models
			for param, target_param in zip(self.critic.parameters(), self.critic_target.parameters()):
				target_param.data.copy_(self.tau * param.data + (1 - self.tau) * target_param.data)

			for param, target_param in zip(self.actor.parameters(), self.actor_target.parameters()):
				target_param.data.copy_(self.tau * param.data + (1 - self.tau) * target_param.data)


# -- utils.py -----------------------------------------------------------------------------------------------
class ReplayBuffer(object):
	def __init__(self, state_dim, action_dim, max_size=int(1e6)):
		self.max_size = max_size
		self.ptr = 0
		self.size = 0

		self.state = np.zeros((max_size, state_dim))
		self.action = np.zeros((max_size, action_dim))
		self.next_state = np.zeros((max_size, state_dim))
		self.reward = np.zeros((max_size, 1))
		self.not_done = np.zeros((max_size, 1))

		self.device = torch.device("cpu")

	def add(self, state, action, next_state, reward, done):
		self.state[self.ptr] = state
		self.action[self.ptr] = action
		self.next_state[self.ptr] = next_state
		self.reward[self.ptr] = reward
		self.not_done[self.ptr] = 1. - done

		self.ptr = (self.ptr + 1) % self.max_size
		self.size = min(self.size + 1, self.max_size)

	def sample(self, batch_size):
		ind = np.random.randint(0, self.size, size=batch_size)

		return (
			torch.FloatTensor(self.state[ind]).to(self.device),
			torch.FloatTensor(self.action[ind]).to(self.device),
			torch.FloatTensor(self.next_state[ind]).to(self.device),
			torch.FloatTensor(self.reward[ind]).to(self.device),
			torch.FloatTensor(self.not_done[ind]).to(self.device)
		)


# -- a linear environment in gym's interface ----------------------------------------------------------------
class Env:
	_max_episode_steps = MAX_EPISODE_STEPS

	def __init__(self):
		np.random.seed(0)
		rng = np.random.RandomState(3)
		self.a, self.b = rng.randn(STATE_DIM, STATE_DIM) * 0.5, rng.randn(STATE_DIM, ACTION_DIM)

	def reset(self):
		self.t, self.s = 0, np.random.uniform(-1, 1, STATE_DIM)
		return self.s

	def sample_action(self):
		return np.random.uniform(-MAX_ACTION, MAX_ACTION, ACTION_DIM)

	def step(self, action):
		self.t += 1
		self.s = self.a @ self.s + self.b @ action
		return self.s, -float(self.s @ self.s), self.t >= MAX_EPISODE_STEPS, {}


def make_nets():
	actor, critic = Actor(STATE_DIM, ACTION_DIM, MAX_ACTION), Critic(STATE_DIM, ACTION_DIM)
	return nn.ModuleDict({'actor': actor, 'actor_target': copy.deepcopy(actor),
						  'critic': critic, 'critic_target': copy.deepcopy(critic)})


# -- main.py ------------------------------------------------------------------------------------------------
def play(env, replay_buffer, select_action):
	"""main.py's loop over environment steps, up to each ``policy.train`` (yielded)."""
	state, done = env.reset(), False
	episode_timesteps = 0
	for t in range(START_TIMESTEPS + STEPS):
		episode_timesteps += 1
		if t < START_TIMESTEPS:
			action = env.sample_action()
		else:
			action = (
				select_action(np.array(state))
				+ np.random.normal(0, MAX_ACTION * EXPL_NOISE, size=ACTION_DIM)
			).clip(-MAX_ACTION, MAX_ACTION)
		next_state, reward, done, _ = env.step(action)
		done_bool = float(done) if episode_timesteps < env._max_episode_steps else 0
		replay_buffer.add(state, action, next_state, reward, done_bool)
		state = next_state
		if t >= START_TIMESTEPS:
			yield t
		if done:
			state, done = env.reset(), False
			episode_timesteps = 0


def td3_hand(nets, data):
	env = data.env
	policy = TD3(nets, MAX_ACTION, policy_noise=0.2 * MAX_ACTION, noise_clip=0.5 * MAX_ACTION)
	replay_buffer = ReplayBuffer(STATE_DIM, ACTION_DIM)
	for t in play(env, replay_buffer, policy.select_action):
		policy.train(replay_buffer, BATCH)


class Transitions:
	"""The port's data: plays the environment with the current actor, yields each sampled batch."""

	def __init__(self, nets):
		self.env, self.policy = Env(), TD3(nets, MAX_ACTION)
		self.replay_buffer = ReplayBuffer(STATE_DIM, ACTION_DIM)

	def __len__(self):
		return STEPS

	def __iter__(self):
		for t in play(self.env, self.replay_buffer, self.policy.select_action):
			yield self.replay_buffer.sample(BATCH)


class TD3Trainer(Trainer):
	automatic = False
	discount, tau, policy_noise, noise_clip, policy_freq = 0.99, 0.005, 0.2 * MAX_ACTION, 0.5 * MAX_ACTION, 2

	def configure_optimizers(self):
		self.total_it = 0
		return {"critic": torch.optim.Adam(self.model['critic'].parameters(), lr=3e-4),
				"actor": torch.optim.Adam(self.model['actor'].parameters(), lr=3e-4)}

	def training_step(self, batch):
		nets = self.model
		self.total_it += 1
		state, action, next_state, reward, not_done = batch
		with torch.no_grad():
			noise = (torch.randn_like(action) * self.policy_noise).clamp(-self.noise_clip, self.noise_clip)
			next_action = (nets['actor_target'](next_state) + noise).clamp(-MAX_ACTION, MAX_ACTION)
			target_Q1, target_Q2 = nets['critic_target'](next_state, next_action)
			target_Q = torch.min(target_Q1, target_Q2)
			target_Q = reward + not_done * self.discount * target_Q
		current_Q1, current_Q2 = nets['critic'](state, action)
		critic_loss = F.mse_loss(current_Q1, target_Q) + F.mse_loss(current_Q2, target_Q)
		self.backward(critic_loss, optimizer="critic")
		self.step("critic")
		losses = {"critic": critic_loss}
		if self.total_it % self.policy_freq == 0:
			actor_loss = -nets['critic'].Q1(state, nets['actor'](state)).mean()
			self.backward(actor_loss, optimizer="actor")
			self.step("actor")
			for param, target_param in zip(nets['critic'].parameters(), nets['critic_target'].parameters()):
				target_param.data.copy_(self.tau * param.data + (1 - self.tau) * target_param.data)
			for param, target_param in zip(nets['actor'].parameters(), nets['actor_target'].parameters()):
				target_param.data.copy_(self.tau * param.data + (1 - self.tau) * target_param.data)
			losses["actor"] = actor_loss
		return losses


@pytest.mark.parametrize("check", checks())
def test_td3_with_delayed_actor_updates_and_soft_targets_through_data(check):
	compare(make_nets, td3_hand, TD3Trainer, Transitions, check, steps=STEPS)
