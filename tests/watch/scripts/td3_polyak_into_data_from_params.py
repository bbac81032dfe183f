# TD3 (sfujim/TD3, TD3.py TD3.train) with the polyak update written as many DDPG/TD3 ports write it:
# `target_param.data.copy_(tau * param + (1 - tau) * target_param)`, the right side built from the parameters
# themselves (with a graph) outside torch.no_grad(): the write goes into `.data`, so the targets stay leaves.
import copy
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 16), nn.Linear(4, 16)
        self.o1, self.o2 = nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, state, action):
        sa = torch.cat([state, action], 1)
        return self.o1(F.relu(self.l1(sa))), self.o2(F.relu(self.l2(sa)))

    def Q1(self, state, action):
        return self.o1(F.relu(self.l1(torch.cat([state, action], 1))))


actor = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1), nn.Tanh())
actor_target, critic = copy.deepcopy(actor), Critic()
critic_target = copy.deepcopy(critic)
actor_optimizer = torch.optim.Adam(actor.parameters(), lr=3e-4)
critic_optimizer = torch.optim.Adam(critic.parameters(), lr=3e-4)
buffer = [torch.randn(64, 3), torch.rand(64, 1) * 2 - 1, torch.randn(64, 3), torch.randn(64, 1), torch.ones(64, 1)]
total_it = 0
for it in range(8):
    total_it += 1
    ind = torch.randint(0, 64, (16,))
    state, action, next_state, reward, not_done = (b[ind] for b in buffer)
    with torch.no_grad():
        noise = (torch.randn_like(action) * 0.2).clamp(-0.5, 0.5)
        next_action = (actor_target(next_state) + noise).clamp(-1, 1)
        target_Q1, target_Q2 = critic_target(next_state, next_action)
        target_Q = reward + not_done * 0.99 * torch.min(target_Q1, target_Q2)
    current_Q1, current_Q2 = critic(state, action)
    critic_loss = F.mse_loss(current_Q1, target_Q) + F.mse_loss(current_Q2, target_Q)
    critic_optimizer.zero_grad()
    critic_loss.backward()
    critic_optimizer.step()
    if total_it % 2 == 0:
        actor_loss = -critic.Q1(state, actor(state)).mean()
        actor_optimizer.zero_grad()
        actor_loss.backward()
        actor_optimizer.step()
        for param, target_param in zip(critic.parameters(), critic_target.parameters()):
            target_param.data.copy_(0.005 * param + (1 - 0.005) * target_param)
        for param, target_param in zip(actor.parameters(), actor_target.parameters()):
            target_param.data.copy_(0.005 * param + (1 - 0.005) * target_param)
        print(it, f"{critic_loss.item():.6f} {actor_loss.item():.6f}")
print(actor_target[0].weight.sum().item())
