# Soft actor-critic as stable-baselines3 writes it: each network holds its own optimizer (`actor.optimizer`), an
# agent object holds the networks and the entropy coefficient's optimizer. The actor's sample, made before the
# entropy and critic updates, goes into the actor's loss after them: one iteration, three optimizer steps.
import hashlib

import torch
from torch import nn


class Agent:
    def __init__(self):
        self.actor = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2))
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.actor.optimizer = torch.optim.Adam(self.actor.parameters(), lr=1e-3)
        self.critic.optimizer = torch.optim.Adam(self.critic.parameters(), lr=1e-3)
        self.log_ent_coef = torch.zeros(1, requires_grad=True)
        self.ent_coef_optimizer = torch.optim.Adam([self.log_ent_coef], lr=1e-3)


torch.manual_seed(0)
agent = Agent()
for step in range(4):
    obs, action, reward = torch.randn(8, 3), torch.randn(8, 1).tanh(), torch.randn(8, 1)
    mean, log_std = agent.actor(obs).chunk(2, dim=-1)
    normal = torch.distributions.Normal(mean, log_std.clamp(-5, 2).exp())
    sample = normal.rsample()
    actions_pi = torch.tanh(sample)
    log_prob = normal.log_prob(sample) - torch.log(1 - actions_pi.pow(2) + 1e-6)
    ent_coef = torch.exp(agent.log_ent_coef.detach())
    ent_coef_loss = -(agent.log_ent_coef * (log_prob - 1.0).detach()).mean()
    agent.ent_coef_optimizer.zero_grad()
    ent_coef_loss.backward()
    agent.ent_coef_optimizer.step()
    with torch.no_grad():
        target = reward + 0.99 * agent.critic(torch.cat([obs, action], 1))
    critic_loss = (agent.critic(torch.cat([obs, action], 1)) - target).pow(2).mean()
    agent.critic.optimizer.zero_grad()
    critic_loss.backward()
    agent.critic.optimizer.step()
    actor_loss = (ent_coef * log_prob - agent.critic(torch.cat([obs, actions_pi], 1))).mean()
    agent.actor.optimizer.zero_grad()
    actor_loss.backward()
    agent.actor.optimizer.step()
    print(f"step {step} actor {actor_loss.item():.6f} critic {critic_loss.item():.6f}")
params = [*agent.actor.parameters(), *agent.critic.parameters(), agent.log_ent_coef]
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest())
