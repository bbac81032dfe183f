# Deep mutual learning after chxy95/Deep-Mutual-Learning's train loop: every peer's output first, then for each peer,
# in a loop over the peers, its cross-entropy plus the KL to the others' detached outputs, and its own zero_grad,
# backward and step (one backward line, a step per peer in each iteration). Correct.
import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model_num = 2
models = [nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(model_num)]
optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
loss_kl = nn.KLDivLoss(reduction="batchmean")
data = [(torch.randn(8, 10), torch.randint(0, 3, (8,))) for _ in range(3)]

for epoch in range(2):
    for images, labels in data:
        outputs = [model(images) for model in models]
        for i in range(model_num):
            ce_loss = F.cross_entropy(outputs[i], labels)
            kl_loss = 0
            for j in range(model_num):
                if i != j:
                    kl_loss += loss_kl(F.log_softmax(outputs[i], dim=1), F.softmax(outputs[j].detach(), dim=1))
            loss = ce_loss + kl_loss / (model_num - 1)
            optimizers[i].zero_grad()
            loss.backward()
            optimizers[i].step()
        print(f"{loss.item():.6f}")
print(hashlib.sha1(b"".join(p.detach().numpy().tobytes() for m in models for p in m.parameters())).hexdigest())
