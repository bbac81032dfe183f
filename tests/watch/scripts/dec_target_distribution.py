# DEC (deep embedded clustering; XifengGuo/DEC-keras, vlukiyanov/pt-dec ptdec/model.py train): every
# `update_interval` batches the soft assignments q of the whole data set are computed under torch.no_grad() and
# sharpened into the target distribution p, kept for the next batches; each batch's loss is KL(p_batch || q_batch)
# through the encoder and the trainable cluster centers (a Parameter of the clustering layer).
import hashlib

import torch
from torch import nn

torch.manual_seed(0)


class DEC(nn.Module):
    def __init__(self, n_clusters=3, dim=4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, dim))
        self.cluster_centers = nn.Parameter(torch.randn(n_clusters, dim))

    def forward(self, x):
        z = self.encoder(x)
        q = 1.0 / (1.0 + torch.sum((z.unsqueeze(1) - self.cluster_centers) ** 2, 2))
        return q / torch.sum(q, 1, keepdim=True)


def target_distribution(q):
    weight = q ** 2 / torch.sum(q, 0)
    return (weight.t() / torch.sum(weight, 1)).t()


data = torch.randn(24, 10)
model = DEC()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loss_function = nn.KLDivLoss(reduction="sum")
batch_size, update_interval = 8, 3
for ite in range(9):
    if ite % update_interval == 0:
        with torch.no_grad():
            p = target_distribution(model(data))
    idx = slice((ite % 3) * batch_size, (ite % 3 + 1) * batch_size)
    output = model(data[idx])
    loss = loss_function(output.log(), p[idx]) / output.shape[0]
    optimizer.zero_grad()
    loss.backward()
    optimizer.step(closure=None)
    print(f"iteration {ite}: loss {loss.item()!r}")
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest())
