# An adversarial patch trained as the UvA deep learning course's tutorial 10 writes it (phlippe/uvadlc_notebooks,
# Adversarial_Attacks, patch_attack), for two epochs over batches held in a list: the patch is written by slice
# assignment into each image, `img[i, :, h:h + ph, w:w + pw] = patch_forward(patch)`, in place, so the list's tensors
# keep the first epoch's graphs, which the second epoch back-propagates again. The loss goes through the write (the
# patch's gradient does): the fix writes into a copy (`img = img.clone()`), never a detached patch.
import numpy as np
import torch
from torch import nn

NORM_MEAN, NORM_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
TENSOR_MEANS, TENSOR_STD = torch.FloatTensor(NORM_MEAN)[:, None, None], torch.FloatTensor(NORM_STD)[:, None, None]


def patch_forward(patch):
    # Map patch values from [-infty,infty] to ImageNet min and max
    patch = (torch.tanh(patch) + 1 - 2 * TENSOR_MEANS) / (2 * TENSOR_STD)
    return patch


def place_patch(img, patch):
    for i in range(img.shape[0]):
        h_offset = np.random.randint(0, img.shape[2] - patch.shape[1] - 1)
        w_offset = np.random.randint(0, img.shape[3] - patch.shape[2] - 1)
        img[i, :, h_offset:h_offset + patch.shape[1], w_offset:w_offset + patch.shape[2]] = patch_forward(patch)
    return img


np.random.seed(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
model.eval()
for p in model.parameters():
    p.requires_grad = False
train_batches = [(torch.randn(4, 3, 10, 10), torch.randint(5, (4,))) for _ in range(4)]
target_class = 3
patch = nn.Parameter(torch.zeros(3, 4, 4), requires_grad=True)
optimizer = torch.optim.SGD([patch], lr=1e-1, momentum=0.8)
loss_module = nn.CrossEntropyLoss()
for epoch in range(2):
    for img, _ in train_batches:
        img = place_patch(img, patch)
        pred = model(img)
        labels = torch.zeros(img.shape[0], dtype=torch.long).fill_(target_class)
        loss = loss_module(pred, labels)
        optimizer.zero_grad()
        loss.mean().backward()
        optimizer.step()
        print(f"{loss.item():.6f}")
print(" ".join(f"{v:.6f}" for v in patch.flatten().tolist()[:8]))
