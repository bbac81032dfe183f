# DQN by hand: each transition is stored in the replay buffer with its TD target, computed from the online network
# as it is collected (meant: under torch.no_grad()); updates sample the buffer.
import random

import torch
from torch import nn

torch.manual_seed(0)
random.seed(0)
q = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.Adam(q.parameters(), lr=0.01)
buffer = []
state = torch.randn(4)
for step in range(8):
    action = int(q(state).argmax())
    next_state, reward = torch.randn(4), float(action)
    target = reward + 0.9 * q(next_state).max()
    buffer.append((state, action, target))
    state = next_state
    batch = random.sample(buffer, min(len(buffer), 2))
    loss = sum((q(s)[a] - t) ** 2 for s, a, t in batch) / len(batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.6f}")
