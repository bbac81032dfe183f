# Trimmed from mlfoundations/open_clip, src/open_clip/model.py (logit_scale = nn.Parameter(log(1/0.07))),
# src/open_clip/loss.py (ClipLoss) and src/open_clip_train/train.py (train_one_epoch): the symmetric contrastive
# loss at a learned temperature, then after the optimizer step `with torch.no_grad(): logit_scale.clamp_(0,
# math.log(100))`, a parameter written in place between steps. Correct: nothing to report.
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class CLIP(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual, self.text = nn.Linear(10, 6), nn.Embedding(20, 6)
        # open_clip: log(1 / 0.07); above the clamp here, so that it bites
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.005))

    def forward(self, image, text):
        image_features = F.normalize(self.visual(image), dim=-1)
        text_features = F.normalize(self.text(text).mean(1), dim=-1)
        return image_features, text_features, self.logit_scale.exp()


def clip_loss(image_features, text_features, logit_scale):
    logits_per_image = logit_scale * image_features @ text_features.T
    logits_per_text = logit_scale * text_features @ image_features.T
    labels = torch.arange(logits_per_image.shape[0], dtype=torch.long)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


torch.manual_seed(0)
model = CLIP()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.2)
for i in range(5):
    images, texts = torch.randn(8, 10), torch.randint(0, 20, (8, 5))
    optimizer.zero_grad()
    model_out = model(images, texts)
    total_loss = clip_loss(*model_out)
    total_loss.backward()
    optimizer.step()
    # Note: we clamp to 4.6052 = ln(100), as in the original paper.
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(100))
    print(f"step {i} loss {total_loss.item():.6f} logit_scale {model.logit_scale.item():.6f}")
print(model.visual.weight.sum().item())
