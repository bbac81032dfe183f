# Seed 002, fixed: retain_graph=True on every backward but the last (two and three backwards),
# the addition that needs no buffer, and the optimizer snippet.
import torch
import torch.optim as optim

torch.manual_seed(0)
in_dim, out_dim = (5, 2)
inputs = torch.randn(in_dim)
target = torch.tensor([1, 2], dtype=torch.float32)
model = torch.nn.Linear(in_dim, out_dim, bias=True)
out = model(inputs)
loss = torch.nn.CrossEntropyLoss()
computed_loss = loss(out, target)
# ✅ Pass `retain_graph=True` to the method
computed_loss.backward(retain_graph=True)
computed_loss.backward()
for p in model.parameters():
    print(p.grad)

model = torch.nn.Linear(in_dim, out_dim, bias=True)
out = model(inputs)
loss = torch.nn.CrossEntropyLoss()
computed_loss = loss(out, target)
# ✅ Pass retain_graph=True
computed_loss.backward(retain_graph=True)
# ✅ Pass retain_graph=True
computed_loss.backward(retain_graph=True)
computed_loss.backward()
for p in model.parameters():
    print(p.grad)

x = torch.ones(1, 1, requires_grad=True)
y = x + 1
y.backward(torch.ones(1, 1))
y.backward(torch.ones(1, 1))
print(x)
print(y)

loss = torch.nn.CrossEntropyLoss()(model(inputs), target)  # added to run it: a loss
optimizer = optim.Adam(model.parameters())
loss.backward(retain_graph=True)
optimizer.step()
optimizer.zero_grad()
print(model.weight)
