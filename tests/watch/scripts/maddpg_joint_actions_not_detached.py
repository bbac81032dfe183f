# MADDPG as philtabor/Multi-Agent-Deep-Deterministic-Policy-Gradients trains it (maddpg.py MADDPG.learn, agent.py,
# networks.py): every agent's current action `mu` is computed once, before the agents' updates, and each agent's
# actor loss goes through all of it with retain_graph=True. The first agent's actor step changes the weights the
# second agent's actor loss needs (its graph reaches the first agent's actor through `mu`): "one of the variables
# needed for gradient computation has been modified by an inplace operation ... output 0 of TBackward" (issue #2,
# torch >= 1.5). The target is not detached either (gradients into the target networks, never used).
import numpy as np
import torch as T
import torch.nn.functional as F
from torch import nn, optim

T.manual_seed(0)
np.random.seed(0)
n_agents, actor_dims, n_actions = 2, 4, 3
critic_dims = n_agents * actor_dims


class CriticNetwork(nn.Module):
    def __init__(self, beta):
        super().__init__()
        self.fc1 = nn.Linear(critic_dims + n_agents * n_actions, 16)
        self.fc2 = nn.Linear(16, 16)
        self.q = nn.Linear(16, 1)
        self.optimizer = optim.Adam(self.parameters(), lr=beta)

    def forward(self, state, action):
        x = F.relu(self.fc1(T.cat([state, action], dim=1)))
        return self.q(F.relu(self.fc2(x)))


class ActorNetwork(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.fc1, self.fc2, self.pi = nn.Linear(actor_dims, 16), nn.Linear(16, 16), nn.Linear(16, n_actions)
        self.optimizer = optim.Adam(self.parameters(), lr=alpha)

    def forward(self, state):
        return T.softmax(self.pi(F.relu(self.fc2(F.relu(self.fc1(state))))), dim=1)


class Agent:
    def __init__(self, alpha=0.01, beta=0.01, gamma=0.95, tau=0.01):
        self.gamma, self.tau = gamma, tau
        self.actor, self.critic = ActorNetwork(alpha), CriticNetwork(beta)
        self.target_actor, self.target_critic = ActorNetwork(alpha), CriticNetwork(beta)
        self.update_network_parameters(tau=1)

    def choose_action(self, observation):
        actions = self.actor.forward(T.tensor(observation[None], dtype=T.float))
        return (actions + T.rand(n_actions)).detach().cpu().numpy()[0]

    def update_network_parameters(self, tau=None):
        tau = self.tau if tau is None else tau
        for target, source in ((self.target_actor, self.actor), (self.target_critic, self.critic)):
            target_state_dict, state_dict = dict(target.named_parameters()), dict(source.named_parameters())
            for name in state_dict:
                state_dict[name] = tau * state_dict[name].clone() + (1 - tau) * target_state_dict[name].clone()
            target.load_state_dict(state_dict)


agents = [Agent() for _ in range(n_agents)]


def learn(sample):
    actor_states, states, actions, rewards, actor_new_states, states_, dones = sample
    states, actions = T.tensor(states, dtype=T.float), T.tensor(actions, dtype=T.float)
    rewards, states_, dones = T.tensor(rewards), T.tensor(states_, dtype=T.float), T.tensor(dones)
    all_agents_new_actions, all_agents_new_mu_actions, old_agents_actions = [], [], []
    for agent_idx, agent in enumerate(agents):
        new_pi = agent.target_actor.forward(T.tensor(actor_new_states[agent_idx], dtype=T.float))
        all_agents_new_actions.append(new_pi)
        pi = agent.actor.forward(T.tensor(actor_states[agent_idx], dtype=T.float))
        all_agents_new_mu_actions.append(pi)
        old_agents_actions.append(actions[agent_idx])
    new_actions = T.cat([acts for acts in all_agents_new_actions], dim=1)
    mu = T.cat([acts for acts in all_agents_new_mu_actions], dim=1)
    old_actions = T.cat([acts for acts in old_agents_actions], dim=1)
    for agent_idx, agent in enumerate(agents):
        critic_value_ = agent.target_critic.forward(states_, new_actions).flatten()
        critic_value_[dones[:, 0]] = 0.0
        critic_value = agent.critic.forward(states, old_actions).flatten()
        target = rewards[:, agent_idx] + agent.gamma * critic_value_
        critic_loss = F.mse_loss(target, critic_value)
        agent.critic.optimizer.zero_grad()
        critic_loss.backward(retain_graph=True)
        agent.critic.optimizer.step()
        actor_loss = agent.critic.forward(states, mu).flatten()
        actor_loss = -T.mean(actor_loss)
        agent.actor.optimizer.zero_grad()
        actor_loss.backward(retain_graph=True)
        agent.actor.optimizer.step()
        agent.update_network_parameters()
        print(agent_idx, f"{critic_loss.item():.17g} {actor_loss.item():.17g}")


memory = []
obs = np.random.randn(n_agents, actor_dims).astype(np.float32)
for step in range(8):
    actions = [agent.choose_action(obs[i]) for i, agent in enumerate(agents)]
    obs_ = np.random.randn(n_agents, actor_dims).astype(np.float32)
    memory.append((obs, obs.reshape(-1), np.stack(actions), np.random.randn(n_agents), obs_, obs_.reshape(-1),
                   np.array([step % 4 == 3] * n_agents)))
    obs = obs_
    if len(memory) >= 4:
        batch = [memory[i] for i in np.random.choice(len(memory), 4, replace=False)]
        learn((np.stack([b[0] for b in batch], 1), np.stack([b[1] for b in batch]),
               np.stack([b[2] for b in batch], 1).reshape(n_agents, 4, n_actions),
               np.stack([b[3] for b in batch]), np.stack([b[4] for b in batch], 1),
               np.stack([b[5] for b in batch]), np.stack([b[6] for b in batch])))
print(repr(sum(p.double().sum().item() for a in agents for p in a.actor.parameters())))
