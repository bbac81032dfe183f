# Learning without Forgetting (Li & Hoiem, Algorithm 1) with the old head's responses y_o, recorded once before
# training on the new task, computed without torch.no_grad(): they keep the graph of that forward through the body
# and old head the loop trains. Recomputing them inside the loop would make them the trained network's own outputs
# (no memory of the original network): the fix keeps them as constants.
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.old_head, self.new_head = nn.Linear(16, 4), nn.Linear(16, 3)

    def forward(self, x):
        h = self.body(x)
        return self.old_head(h), self.new_head(h)


def distill(logits, recorded, T=2.0):
    return F.kl_div(F.log_softmax(logits / T, 1), F.softmax(recorded / T, 1), reduction="batchmean") * T * T


torch.manual_seed(0)
model = Net()
x_new, y_new = torch.randn(12, 6), torch.randint(0, 3, (12,))
y_o = model(x_new)[0]
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for i in range(0, 12, 4):
        old_logits, new_logits = model(x_new[i:i + 4])
        loss = F.cross_entropy(new_logits, y_new[i:i + 4]) + distill(old_logits, y_o[i:i + 4])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"{loss.item():.6f}")
print(" ".join(f"{v:.6f}" for v in model.old_head.weight.flatten()[:6].tolist()))
