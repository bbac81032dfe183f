"""fairseq's out-of-memory handling in its training step (facebookresearch/fairseq, fairseq/trainer.py,
`train_step`: `except RuntimeError as e: if "out of memory" in str(e): ... skipping batch`), as a plain loop:
the forward and backward inside `try`, an OOM skipped with `continue` after zeroing the gradients, any other error
raised again, and a `finally` that counts the batch. One batch raises a fake OOM here."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(6, 1)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
batches = [torch.randn(5, 6) for _ in range(6)]
seen = 0
for i, sample in enumerate(batches):
    try:
        if i == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = model(sample).pow(2).mean()
        loss.backward()
    except RuntimeError as e:
        if "out of memory" in str(e):
            print("| WARNING: ran out of memory, skipping batch")
            optimizer.zero_grad()
            continue
        else:
            raise e
    finally:
        seen += 1
    optimizer.step()
    optimizer.zero_grad()
    print(i, loss.item())
print(seen, model.weight.sum().item(), model.bias.sum().item())
