# pytorch/examples' time_sequence_prediction step: the forward inside the L-BFGS closure, which step() runs
# several times, each evaluation on a graph of its own.
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
criterion = nn.MSELoss()
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.8)
x, y = torch.randn(32, 4), torch.randn(32, 1)

for i in range(3):
    def closure():
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    print(f"step {i}: loss {criterion(model(x), y).item():.6f}")
