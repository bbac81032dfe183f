# Transfer learning in two phases as in unfreeze_new_optimizer.py (the backbone frozen and an SGD over the new head,
# as PyTorch's transfer learning tutorial has it, then the whole network fine-tuned once unfrozen, on larger inputs),
# with the mistake of keeping the first phase's optimizer, which was never given the backbone: in the second phase the
# backbone gets gradients that go nowhere.
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
    for epoch in range(2):
        for inputs, labels in data[size]:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
        print(f"phase {phase} epoch {epoch}: {loss.item():.6f}")
print(hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
