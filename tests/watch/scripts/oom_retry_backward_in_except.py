"""seed001_reused_graph.py's mistake (features made once by a trained encoder, before the loop) in a loop whose
first step runs its backward inside an `except` block: an out-of-memory retry back-propagating the batch in two
halves (retain_graph=True between them). The first batch runs out of memory here (a raised RuntimeError)."""
import torch

torch.manual_seed(0)
enc, model = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)
optimizer = torch.optim.SGD([*enc.parameters(), *model.parameters()], lr=0.1)
feat = enc(torch.randn(8, 6))
for i in range(3):
    optimizer.zero_grad()
    try:
        if i == 0:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = model(feat).pow(2).mean()
        loss.backward()
    except RuntimeError:
        for half in feat.chunk(2):
            loss = model(half).pow(2).mean() / 2
            loss.backward(retain_graph=True)
    optimizer.step()
    print(i, loss.item())
