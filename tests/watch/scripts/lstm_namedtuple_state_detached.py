# An LSTM cell whose state is a namedtuple, as pytorch/benchmarks' fastrnns/custom_lstms.py keeps it, carried from
# step to step and detached at the end of each step by making the namedtuple again with its own class.
from collections import namedtuple

import torch
from torch import nn

LSTMState = namedtuple("LSTMState", ["hx", "cx"])
torch.manual_seed(0)
cell = nn.LSTMCell(3, 5)
head = nn.Linear(5, 1)
opt = torch.optim.SGD([*cell.parameters(), *head.parameters()], lr=0.1)
state = LSTMState(torch.zeros(2, 5), torch.zeros(2, 5))
for step in range(4):
    hx, cx = cell(torch.randn(2, 3), (state.hx, state.cx))
    state = LSTMState(hx, cx)
    loss = head(state.hx).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    state = type(state)(*(t.detach() for t in state))
    print(f"step {step}: loss {loss.item()!r}")
