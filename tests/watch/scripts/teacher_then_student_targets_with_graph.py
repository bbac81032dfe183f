# Two training loops: a teacher trained, then a student trained on the teacher's outputs, computed once between the
# loops without torch.no_grad(): each keeps the teacher's graph, freed by its first backward, so the student's second
# pass fails. Stopped at the student's first step, as a graph built before that loop.
import torch
from torch import nn

torch.manual_seed(0)
teacher, student = nn.Linear(4, 4), nn.Linear(4, 4)
x_all, y_all = torch.randn(5, 8, 4), torch.randn(5, 8, 4)
opt_t = torch.optim.SGD(teacher.parameters(), lr=0.1)
for x, y in zip(x_all, y_all):
    loss = (teacher(x) - y).pow(2).mean()
    opt_t.zero_grad()
    loss.backward()
    opt_t.step()
# phase 2: the student learns the teacher's outputs, computed once
targets = [teacher(x) for x in x_all]
opt_s = torch.optim.SGD(student.parameters(), lr=0.1)
for epoch in range(2):
    for x, t in zip(x_all, targets):
        loss = (student(x) - t).pow(2).mean()
        opt_s.zero_grad()
        loss.backward()
        opt_s.step()
print(repr(student.weight.sum().item()))
