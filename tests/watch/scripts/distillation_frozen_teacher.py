# Trimmed from pytorch/tutorials, beginner_source/knowledge_distillation_tutorial.py (train_knowledge_distillation):
# the teacher in eval mode, its logits under torch.no_grad(), soft targets at temperature T scaled by T**2, plus the
# student's cross entropy; then the same with a teacher frozen by requires_grad_(False) and no no_grad. Correct.
import torch
import torch.nn as nn

torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))


def train_knowledge_distillation(teacher, student, T, soft_target_loss_weight, ce_loss_weight, no_grad):
    ce_loss = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(student.parameters(), lr=0.01)
    teacher.eval()
    student.train()
    for epoch in range(3):
        inputs, labels = torch.randn(16, 6), torch.randint(0, 3, (16,))
        optimizer.zero_grad()
        if no_grad:
            with torch.no_grad():
                teacher_logits = teacher(inputs)
        else:
            teacher_logits = teacher(inputs)
        student_logits = student(inputs)
        soft_targets = nn.functional.softmax(teacher_logits / T, dim=-1)
        soft_prob = nn.functional.log_softmax(student_logits / T, dim=-1)
        soft_targets_loss = torch.sum(soft_targets * (soft_targets.log() - soft_prob)) / soft_prob.size()[0] * (T**2)
        label_loss = ce_loss(student_logits, labels)
        loss = soft_target_loss_weight * soft_targets_loss + ce_loss_weight * label_loss
        loss.backward()
        optimizer.step()
        print(f"no_grad={no_grad} epoch {epoch} loss {loss.item():.6f}")


student = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
train_knowledge_distillation(teacher, student, T=2, soft_target_loss_weight=0.25, ce_loss_weight=0.75, no_grad=True)
teacher.requires_grad_(False)
train_knowledge_distillation(teacher, student, T=2, soft_target_loss_weight=0.25, ce_loss_weight=0.75, no_grad=False)
print(student[0].weight.sum().item(), [p.grad for p in teacher.parameters()][:1])
