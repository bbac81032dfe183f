# distillation_frozen_teacher.py's loop (pytorch/tutorials, beginner_source/knowledge_distillation_tutorial.py) with
# the teacher's logits computed outside torch.no_grad() and the teacher left trainable: every backward also fills
# the teacher's .grad, which no optimizer holds. Wasted work, not a wrong update: quiet, as for any part of a model
# left out of the optimizer on purpose (docs/guard.md, the unused-gradient check).
import torch
import torch.nn as nn

torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
student = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
ce_loss = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(student.parameters(), lr=0.01)
T, soft_target_loss_weight, ce_loss_weight = 2, 0.25, 0.75
teacher.eval()
student.train()
for epoch in range(4):
    inputs, labels = torch.randn(16, 6), torch.randint(0, 3, (16,))
    optimizer.zero_grad()
    teacher_logits = teacher(inputs)
    student_logits = student(inputs)
    soft_targets = nn.functional.softmax(teacher_logits / T, dim=-1)
    soft_prob = nn.functional.log_softmax(student_logits / T, dim=-1)
    soft_targets_loss = torch.sum(soft_targets * (soft_targets.log() - soft_prob)) / soft_prob.size()[0] * (T**2)
    label_loss = ce_loss(student_logits, labels)
    loss = soft_target_loss_weight * soft_targets_loss + ce_loss_weight * label_loss
    loss.backward()
    optimizer.step()
    print(f"epoch {epoch} loss {loss.item():.6f}")
print(student[0].weight.sum().item())
