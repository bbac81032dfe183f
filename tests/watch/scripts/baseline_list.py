"""A moving-average baseline over the past returns, kept in a list with their graphs: the next step's loss
reaches the last step's graph through the list."""
import torch

torch.manual_seed(0)
policy = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(policy.parameters(), lr=0.01)
returns = []
for step in range(5):
    value = policy(torch.randn(8, 4)).mean()
    baseline = torch.stack(returns[-3:]).mean() if returns else torch.zeros(())
    loss = (value - baseline).pow(2)
    returns.append(value)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
