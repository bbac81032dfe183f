"""An out-of-memory retry as training scripts write it (fairseq's trainer catches "out of memory" around its step):
the forward inside `try`, and on the error the batch run again in two halves inside the `except` block, whose first
half's loss only that block assigns (`first`). The first batch runs out of memory here (a raised RuntimeError).
Correct: every loss is made and back-propagated in its own iteration."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(6, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = [torch.randn(8, 6) for _ in range(3)]
for i, batch in enumerate(batches):
    try:
        if i == 0:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = model(batch).pow(2).mean()
    except RuntimeError as e:
        if "out of memory" not in str(e):
            raise
        first = model(batch[:4]).pow(2).mean()
        loss = (first + model(batch[4:]).pow(2).mean()) / 2
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(i, loss.item())
print(model.weight.sum().item(), model.bias.sum().item())
