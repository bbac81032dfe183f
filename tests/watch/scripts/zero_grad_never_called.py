# The canonical loop of preproom.ai's "model training in PyTorch" without its optimizer.zero_grad() ("gradients
# ACCUMULATE"): each step applies the sum of every gradient so far, and the loss oscillates instead of falling.
import torch
import torch.nn as nn

torch.manual_seed(0)
x = torch.linspace(-1, 1, 32).unsqueeze(1)
y = 3 * x + 0.5
model = nn.Linear(1, 1)
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.03)
model.train()
for epoch in range(5):
    pred = model(x)
    loss = criterion(pred, y)
    loss.backward()
    optimizer.step()
    print(f"epoch {epoch}: loss {loss.item():.6f}")
print(f"w {model.weight.item():.6f} b {model.bias.item():.6f}")
