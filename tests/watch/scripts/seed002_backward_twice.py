# Seed 002: the error example.
import torch

in_dim, out_dim = (5, 2)
inputs = torch.randn(in_dim)
target = torch.tensor([1, 2], dtype=torch.float32)
model = torch.nn.Linear(in_dim, out_dim, bias=True)
out = model(inputs)
loss = torch.nn.CrossEntropyLoss()
computed_loss = loss(out, target)
computed_loss.backward()
# ⛔️ RuntimeError: Trying to backward through the graph a second time
computed_loss.backward()
for p in model.parameters():
    print(p.grad)
