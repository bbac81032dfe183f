# Multi-task learning as multi-objective optimization (MGDA), after intel-isl/MultiObjectiveOptimization's
# train_multi_task.py: each task's loss is back-propagated for its gradient on the shared trunk (kept with
# retain_graph=True, copied, then zeroed), the min-norm solver weighs the tasks, and the weighted sum of the same
# losses is back-propagated for the update. The mistake: the per-task backward without retain_graph=True frees the
# trunk's graph that the next task's loss goes through.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
tasks = ["L", "R"]
model = {"rep": nn.Sequential(nn.Linear(8, 16), nn.ReLU()), "L": nn.Linear(16, 3), "R": nn.Linear(16, 3)}
optimizer = torch.optim.SGD([p for m in model.values() for p in m.parameters()], lr=0.1, momentum=0.9)
data = [(torch.randn(8, 8), {t: torch.randint(0, 3, (8,)) for t in tasks}) for _ in range(3)]


def find_min_norm_element(g1, g2):  # MinNormSolver's two-task case
    v1v1, v1v2, v2v2 = g1 @ g1, g1 @ g2, g2 @ g2
    if v1v2 >= v1v1:
        return 0.999
    if v1v2 >= v2v2:
        return 0.001
    return ((v2v2 - v1v2) / (v1v1 + v2v2 - 2 * v1v2)).item()


for epoch in range(2):
    for images, labels in data:
        rep = model["rep"](images)
        grads, losses = {}, {}
        for t in tasks:
            optimizer.zero_grad()
            losses[t] = F.cross_entropy(model[t](rep), labels[t])
            losses[t].backward()  # Bug: retain_graph=True forgotten
            grads[t] = torch.cat([p.grad.detach().flatten() for p in model["rep"].parameters()])
        sol = find_min_norm_element(grads["L"], grads["R"])
        scale = {"L": sol, "R": 1 - sol}
        optimizer.zero_grad()
        loss = sum(scale[t] * losses[t] for t in tasks)
        loss.backward()
        optimizer.step()
        print(f"{sol:.6f} {loss.item():.6f}")
print([round(p.sum().item(), 6) for m in model.values() for p in m.parameters()])
