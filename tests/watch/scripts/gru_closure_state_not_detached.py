"""gru_state_closure_match.py without its `h = h.detach()`: the state the closure keeps in the enclosing function
(`nonlocal h`, `out, h = rnn(x, h)`) carries each step's graph into the next, whose backward fails. Batches from a
generator, a `match` on the batch's shape and `continue` past empty batches, as there."""
import torch
from torch import nn

torch.manual_seed(0)
rnn, head = nn.GRU(3, 5, batch_first=True), nn.Linear(5, 1)
optimizer = torch.optim.RMSprop([*rnn.parameters(), *head.parameters()], lr=1e-2)


def batches(n):
    for i in range(n):
        x, y = torch.randn(2, 4, 3), torch.randn(2, 4, 1)
        if i == 2:
            yield {"x": x[:, :0], "y": y[:, :0]}
        yield {"x": x, "y": y} if i % 2 else (x, y)


def fit(n):
    h = torch.zeros(1, 2, 5)

    def step(x, y):
        nonlocal h
        out, h = rnn(x, h)
        loss = nn.functional.mse_loss(head(out), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    for batch in batches(n):
        match batch:
            case {"x": x, "y": y} | (x, y):
                if x.shape[1] == 0:
                    continue
                print(step(x, y))


fit(5)
for p in [*rnn.parameters(), *head.parameters()]:
    print(p.sum().item())
