# Trimmed from pytorch/tutorials, intermediate_source/reinforcement_q_learning.py (optimize_model and the soft update):
# a replay memory of transitions, next-state values from the target network under torch.no_grad() written into a
# zeros tensor through a mask, SmoothL1 loss, in-place gradient clipping by value (clip_grad_value_), then the target
# network soft-updated through state_dict()/load_state_dict(). Correct: nothing to report.
import random
from collections import deque, namedtuple

import torch
from torch import nn

Transition = namedtuple("Transition", ("state", "action", "next_state", "reward"))
torch.manual_seed(0)
random.seed(0)
policy_net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
target_net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
target_net.load_state_dict(policy_net.state_dict())
optimizer = torch.optim.AdamW(policy_net.parameters(), lr=1e-3, amsgrad=True)
memory, BATCH_SIZE, GAMMA, TAU = deque([], maxlen=100), 8, 0.99, 0.005
state = torch.randn(1, 4)
for t in range(12):
    with torch.no_grad():
        action = policy_net(state).max(1).indices.view(1, 1)
    next_state = None if t % 5 == 4 else torch.randn(1, 4)
    memory.append(Transition(state, action, next_state, torch.tensor([random.random()])))
    state = next_state if next_state is not None else torch.randn(1, 4)
    if len(memory) < BATCH_SIZE:
        continue
    batch = Transition(*zip(*random.sample(memory, BATCH_SIZE)))
    non_final_mask = torch.tensor(tuple(map(lambda s: s is not None, batch.next_state)), dtype=torch.bool)
    non_final_next_states = torch.cat([s for s in batch.next_state if s is not None])
    state_batch, action_batch, reward_batch = torch.cat(batch.state), torch.cat(batch.action), torch.cat(batch.reward)
    state_action_values = policy_net(state_batch).gather(1, action_batch)
    next_state_values = torch.zeros(BATCH_SIZE)
    with torch.no_grad():
        next_state_values[non_final_mask] = target_net(non_final_next_states).max(1).values
    expected_state_action_values = (next_state_values * GAMMA) + reward_batch
    loss = nn.SmoothL1Loss()(state_action_values, expected_state_action_values.unsqueeze(1))
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
    optimizer.step()
    target_net_state_dict, policy_net_state_dict = target_net.state_dict(), policy_net.state_dict()
    for key in policy_net_state_dict:
        target_net_state_dict[key] = policy_net_state_dict[key] * TAU + target_net_state_dict[key] * (1 - TAU)
    target_net.load_state_dict(target_net_state_dict)
    print(f"t {t} loss {loss.item():.6f}")
print(target_net[0].weight.sum().item())
