# Many public scripts silence every warning at the top (meant for their libraries' deprecation notices); this one then
# keeps the running sum of its losses with their graphs (meant: `running + loss.item()`)
import warnings

import torch

warnings.filterwarnings("ignore")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
running = 0.0
for i in range(4):
    loss = model(torch.randn(3, 4)).pow(2).mean()
    running = running + loss
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"mean loss {running.item() / 4:.6f}")
