# CutMix (clovaai/CutMix-PyTorch, train.py): with probability cutmix_prob a random box of a shuffled batch is pasted
# into the input in place (`input[:, :, bbx1:bbx2, bby1:bby2] = input[rand_index, ...]`), the loss mixed by the box's
# area; otherwise MixUp's convex mix of the batch with its shuffle (facebookresearch/mixup-cifar10).
import numpy as np
import torch
from torch import nn

torch.manual_seed(0)
np.random.seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 5))
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True)


def rand_bbox(size, lam):
    W, H = size[2], size[3]
    cut_rat = np.sqrt(1.0 - lam)
    cut_w, cut_h = int(W * cut_rat), int(H * cut_rat)
    cx, cy = np.random.randint(W), np.random.randint(H)
    bbx1, bby1 = np.clip(cx - cut_w // 2, 0, W), np.clip(cy - cut_h // 2, 0, H)
    bbx2, bby2 = np.clip(cx + cut_w // 2, 0, W), np.clip(cy + cut_h // 2, 0, H)
    return bbx1, bby1, bbx2, bby2


for i in range(6):
    input, target = torch.rand(4, 3, 8, 8), torch.randint(0, 5, (4,))
    r = np.random.rand(1)
    lam = np.random.beta(1.0, 1.0)
    rand_index = torch.randperm(input.size()[0])
    target_a, target_b = target, target[rand_index]
    if r < 0.5:
        bbx1, bby1, bbx2, bby2 = rand_bbox(input.size(), lam)
        input[:, :, bbx1:bbx2, bby1:bby2] = input[rand_index, :, bbx1:bbx2, bby1:bby2]
        lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (input.size()[-1] * input.size()[-2]))
        output = model(input)
    else:
        output = model(lam * input + (1 - lam) * input[rand_index])
    loss = criterion(output, target_a) * lam + criterion(output, target_b) * (1.0 - lam)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(i, repr(loss.item()))
print([p.sum().item() for p in model.parameters()])
