import io

import torch

torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    loss = model(torch.randn(4, 3)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module, pickled
    print(step, f"{loss.item():.6f}", len(buffer.getvalue()))
