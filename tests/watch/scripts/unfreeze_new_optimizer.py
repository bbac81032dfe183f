# Transfer learning in two phases, after PyTorch's transfer learning tutorial (the backbone frozen, an SGD over the new
# head) followed by fine-tuning the whole network once unfrozen (fast.ai's freeze / unfreeze): the second phase builds
# its optimizer again, with a lower learning rate for the backbone, and larger inputs (progressive resizing). Correct.
import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
model = nn.Sequential(backbone, nn.Linear(4, 3))
data = {size: [(torch.randn(4, 3, size, size), torch.randint(0, 3, (4,))) for _ in range(2)] for size in (8, 12)}

for param in backbone.parameters():
    param.requires_grad = False
optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)
for phase, size in enumerate((8, 12)):
    if phase == 1:
        for param in backbone.parameters():
            param.requires_grad = True
        optimizer = torch.optim.SGD([{"params": backbone.parameters(), "lr": 0.01},
                                     {"params": model[1].parameters()}], lr=0.05, momentum=0.9)
    for epoch in range(2):
        for inputs, labels in data[size]:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
        print(f"phase {phase} epoch {epoch}: {loss.item():.6f}")
print(hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
