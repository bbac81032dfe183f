# A running statistic kept in a buffer that the forward updates in place outside torch.no_grad() (as
# vector-quantize-pytorch's codebook statistics before its PR #57): the buffer, registered before the loop, holds a
# graph the first step made, which the second step's loss reaches after the first backward freed it.
import torch
from torch import nn
class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("running", torch.zeros(4))
    def forward(self, x):
        h = self.lin(x)
        self.running.mul_(0.9).add_(h.mean(0) * 0.1)  # Bug: outside no_grad
        return h - self.running
torch.manual_seed(0)
model = Norm()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, loss.item())
