"""Second-order MAML adaptation inline: two autograd.grad(create_graph=True) inner steps, the fast weights in a
plain variable, before the first optimizer step: one step."""
import torch

torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(3))
opt = torch.optim.SGD([w], lr=0.1)
for iteration in range(3):
    x = torch.randn(8, 3)
    opt.zero_grad()
    fast = w * 1.0                       # the adapted copy (learn2learn's clone: p.clone())
    for step in range(2):                # adaptation steps
        inner = (x @ fast).pow(2).mean()
        grad, = torch.autograd.grad(inner, fast, create_graph=True)
        fast = fast - 0.1 * grad
    (x @ fast).sin().mean().backward()   # the meta-loss, through the adaptation, into w
    opt.step()
print("trained", w.sum().item())
