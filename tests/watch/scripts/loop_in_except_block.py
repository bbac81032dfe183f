"""seed001_reused_graph.py's mistake (features made once by a trained encoder, before the loop) in a script that
trains only when it finds no checkpoint: the training loop inside `except FileNotFoundError:`."""
import torch

torch.manual_seed(0)
enc, model = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)
optimizer = torch.optim.SGD([*enc.parameters(), *model.parameters()], lr=0.1)
feat = enc(torch.randn(8, 6))
try:
    model.load_state_dict(torch.load("no_such_checkpoint.pt"))
except FileNotFoundError:
    for i in range(3):
        loss = model(feat).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(i, loss.item())
