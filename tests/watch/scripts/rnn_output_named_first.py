"""A GRU's state carried from batch to batch without a detach (`out, h = rnn(x, h)`), where `out = None` is written
before `h` at the top of the script: the second step's backward goes through the first step's graph, which the
first backward freed. The state is `h`, which carries the graph from one step to the next."""
import torch
from torch import nn

torch.manual_seed(0)
rnn, head = nn.GRU(3, 5, batch_first=True), nn.Linear(5, 1)
optimizer = torch.optim.SGD([*rnn.parameters(), *head.parameters()], lr=1e-2)
out = None
h = torch.zeros(1, 2, 5)
for i in range(3):
    x, y = torch.randn(2, 4, 3), torch.randn(2, 4, 1)
    out, h = rnn(x, h)
    loss = nn.functional.mse_loss(head(out), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(loss.item())
