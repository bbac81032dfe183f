# The canonical loop of preproom.ai's "model training in PyTorch" with optimizer.zero_grad() moved to between
# loss.backward() and optimizer.step(), the one place the velog note "where does optimizer.zero_grad() go" says it
# must not be: every step finds its gradients cleared, and the weights never move.
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
    optimizer.zero_grad()
    optimizer.step()
    print(f"epoch {epoch}: loss {loss.item():.6f}")
print(f"w {model.weight.item():.6f} b {model.bias.item():.6f}")
