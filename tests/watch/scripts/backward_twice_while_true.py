"""A second backward through a graph the first one freed, in a function's `while True` loop: the forward under
bf16 autocast in a `with` block, then `loss.backward()`, then an L2 penalty built from `loss` and a list
comprehension over the parameters (inlined on Python 3.12) back-propagated without retain_graph on the first."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def run():
    step = 0
    while True:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(3, 4))
            loss = out.float().pow(2).mean()
        loss.backward()
        reg = loss + sum([p.pow(2).sum() for p in model.parameters()])
        reg.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            break


run()
