# DEC's target distribution p computed without torch.no_grad() (a port that drops the Keras predict's implicit
# no-grad): p keeps the graph of a forward over the whole data set, made in one step and used by the next two, whose
# backward goes through the graph the first freed. A target the loss compares with: computed under no_grad.
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
        p = target_distribution(model(data))
    idx = slice((ite % 3) * batch_size, (ite % 3 + 1) * batch_size)
    output = model(data[idx])
    loss = loss_function(output.log(), p[idx]) / output.shape[0]
    optimizer.zero_grad()
    loss.backward()
    optimizer.step(closure=None)
    print(f"iteration {ite}: loss {loss.item()!r}")
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest())
