# pytorch/examples' reinforcement_learning/actor_critic.py on a made-up environment: the model keeps each episode's
# (log-prob, value) pairs in `model.saved_actions`, a list of namedtuples, and finish_episode builds one loss from
# them. The mistake: the list is never emptied after the backward (the example's `del model.saved_actions[:]`), so
# the next episode's loss goes back through the first episode's freed graph.
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

torch.manual_seed(0)
SavedAction = namedtuple("SavedAction", ["log_prob", "value"])


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 16)
        self.action_head = nn.Linear(16, 2)
        self.value_head = nn.Linear(16, 1)
        self.saved_actions = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.affine1(x))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


model = Policy()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)


def select_action(state):
    probs, state_value = model(state)
    m = Categorical(probs)
    action = m.sample()
    model.saved_actions.append(SavedAction(m.log_prob(action), state_value))
    return action.item()


def finish_episode():
    R = 0
    saved_actions = model.saved_actions
    policy_losses, value_losses, returns = [], [], []
    for r in model.rewards[::-1]:
        R = r + 0.99 * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + 1e-7)
    for (log_prob, value), R in zip(saved_actions, returns):
        advantage = R - value.item()
        policy_losses.append(-log_prob * advantage)
        value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
    optimizer.zero_grad()
    loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
    loss.backward()
    optimizer.step()
    del model.rewards[:]
    return loss.item()


for episode in range(4):
    state = torch.randn(4)
    for t in range(5):
        action = select_action(state)
        state = torch.randn(4) + action
        model.rewards.append(float(action))
    print(f"episode {episode}: loss {finish_episode()!r}")
print(repr(sum(p.double().sum().item() for p in model.parameters())))
