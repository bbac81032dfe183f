# pytorch/examples' time_sequence_prediction step with the forward moved out of the L-BFGS closure: the
# closure's second evaluation back-propagates again through the graph its first one freed.
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
criterion = nn.MSELoss()
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.8)
x, y = torch.randn(32, 4), torch.randn(32, 1)

for i in range(3):
    out = model(x)

    def closure():
        optimizer.zero_grad()
        loss = criterion(out, y)
        loss.backward()
        return loss

    optimizer.step(closure)
    print(f"step {i}: loss {criterion(model(x), y).item():.6f}")
