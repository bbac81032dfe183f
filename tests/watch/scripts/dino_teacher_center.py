# Trimmed from facebookresearch/dino (7c446df), main_dino.py (train_one_epoch, DINOLoss) and utils.py
# (cancel_gradients_last_layer, clip_gradients): a teacher whose parameters are frozen through `requires_grad`, run
# without torch.no_grad(); the teacher's output centred and sharpened, then `.detach()`ed in the loss; the `center`
# buffer replaced by its moving average inside `@torch.no_grad()` `update_center`; multi-crop (two global views for
# the teacher, every view for the student); the last layer's gradients set to None in the first epoch; the teacher
# moved by EMA through `.data` under torch.no_grad().
import hashlib

import torch
import torch.nn.functional as F
from torch import nn


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, teacher_temp=0.04, student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.teacher_temp = teacher_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_output, teacher_output):
        student_out = student_output / self.student_temp
        student_out = student_out.chunk(self.ncrops)
        teacher_out = F.softmax((teacher_output - self.center) / self.teacher_temp, dim=-1)
        teacher_out = teacher_out.detach().chunk(2)
        total_loss = 0
        n_loss_terms = 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        batch_center = batch_center / len(teacher_output)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, bottleneck_dim=6):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, 16), nn.GELU(), nn.Linear(16, bottleneck_dim))
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


torch.manual_seed(0)
student = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), DINOHead(8, 12))
teacher = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), DINOHead(8, 12))
teacher.load_state_dict(student.state_dict())
for p in teacher.parameters():
    p.requires_grad = False
dino_loss = DINOLoss(12, ncrops=4)
optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
for epoch in range(2):
    for it in range(3):
        x = torch.randn(4, 10)
        images = [x + 0.1 * torch.randn_like(x) for _ in range(4)]
        teacher_output = teacher(torch.cat(images[:2]))
        student_output = student(torch.cat(images))
        loss = dino_loss(student_output, teacher_output)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 3.0)
        cancel_gradients_last_layer(epoch, student, 1)
        optimizer.step()
        with torch.no_grad():
            m = 0.99
            for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
        print(epoch, it, repr(loss.item()))
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in
                              [*student.state_dict().values(), *teacher.state_dict().values(), dino_loss.center])
                     ).hexdigest())
