"""A recurrent state carried from step to step, its graph kept with retain_graph=True (the fix PyTorch's error
suggests): each step back-propagates the earlier steps' graphs again, and PyTorch fails at the third."""
import torch
torch.manual_seed(0)
W = torch.nn.Parameter(torch.randn(4, 4) * 0.1)
U = torch.nn.Parameter(torch.randn(4, 4) * 0.1)
opt = torch.optim.SGD([W, U], lr=0.1)
h = torch.zeros(1, 4)
for step in range(4):
    x = torch.randn(1, 4)
    h = torch.tanh(x @ W + h @ U)
    loss = h.pow(2).mean()
    opt.zero_grad()
    loss.backward(retain_graph=True)
    opt.step()
    print(step, loss.item())
