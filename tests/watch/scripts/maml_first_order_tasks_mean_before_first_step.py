"""First-order MAML over a meta-batch of two tasks, each adapted by autograd.grad (no create_graph) from one line,
one backward of the tasks' mean query loss: the second task's inner gradients are the same iteration's, not the loop
come round, before the first optimizer step as after."""
import torch

torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(3))
opt = torch.optim.SGD([w], lr=0.1)
for iteration in range(3):
    opt.zero_grad()
    query_losses = []
    for task in range(2):
        x, y = torch.randn(8, 3), torch.randn(8)
        fast = w.clone()                     # higher's copy_initial_weights=False
        for step in range(2):
            inner = (x @ fast - y).pow(2).mean()
            grad, = torch.autograd.grad(inner, fast)
            fast = fast - 0.1 * grad
        query_losses.append((x @ fast - y).pow(2).mean())
    meta_loss = sum(query_losses) / len(query_losses)
    meta_loss.backward()
    opt.step()
print("trained", w.sum().item())
