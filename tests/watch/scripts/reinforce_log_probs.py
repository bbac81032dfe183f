# pytorch/examples' reinforcement_learning/reinforce.py on a made-up environment, as the example writes it: the
# policy keeps each episode's log-probs in `policy.saved_log_probs`, finish_episode builds one loss from them and
# empties the list after the backward.
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

torch.manual_seed(0)


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 16)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(16, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=1)


policy = Policy()
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)


def select_action(state):
    m = Categorical(policy(state.unsqueeze(0)))
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode():
    R = 0
    policy_loss = []
    returns = deque()
    for r in policy.rewards[::-1]:
        R = r + 0.99 * R
        returns.appendleft(R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + 1e-7)
    for log_prob, R in zip(policy.saved_log_probs, returns):
        policy_loss.append(-log_prob * R)
    optimizer.zero_grad()
    policy_loss = torch.cat(policy_loss).sum()
    policy_loss.backward()
    optimizer.step()
    del policy.rewards[:]
    del policy.saved_log_probs[:]
    return policy_loss.item()


for episode in range(4):
    state = torch.randn(4)
    for t in range(5):
        action = select_action(state)
        state = torch.randn(4) + action
        policy.rewards.append(float(action))
    print(f"episode {episode}: loss {finish_episode()!r}")
print(repr(sum(p.double().sum().item() for p in policy.parameters())))
