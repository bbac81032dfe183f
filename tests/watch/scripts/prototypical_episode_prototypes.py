# Prototypical networks (jakesnell/prototypical-networks protonets/models/few_shot.py loss): each episode embeds its
# support and query examples in one forward of the concatenation, the class prototypes are the means of the support
# embeddings (a view of the same output), and the loss is the cross-entropy of the negative squared distances of the
# queries to the prototypes; Adam with a StepLR per epoch.
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


def euclidean_dist(x, y):
    n, m, d = x.size(0), y.size(0), x.size(1)
    return torch.pow(x.unsqueeze(1).expand(n, m, d) - y.unsqueeze(0).expand(n, m, d), 2).sum(2)


encoder = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
n_class, n_support, n_query = 3, 2, 3
episodes = [(torch.randn(n_class, n_support, 8), torch.randn(n_class, n_query, 8)) for _ in range(3)]
for epoch in range(2):
    for xs, xq in episodes:
        optimizer.zero_grad()
        target_inds = torch.arange(0, n_class).view(n_class, 1, 1).expand(n_class, n_query, 1).long()
        x = torch.cat([xs.view(n_class * n_support, -1), xq.view(n_class * n_query, -1)], 0)
        z = encoder(x)
        z_dim = z.size(-1)
        z_proto = z[:n_class * n_support].view(n_class, n_support, z_dim).mean(1)
        zq = z[n_class * n_support:]
        dists = euclidean_dist(zq, z_proto)
        log_p_y = F.log_softmax(-dists, dim=1).view(n_class, n_query, -1)
        loss_val = -log_p_y.gather(2, target_inds).squeeze().view(-1).mean()
        _, y_hat = log_p_y.max(2)
        acc_val = torch.eq(y_hat, target_inds.squeeze()).float().mean()
        loss_val.backward()
        optimizer.step()
        print(f"epoch {epoch}: loss {loss_val.item()!r} acc {acc_val.item()!r}")
    scheduler.step()
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in encoder.state_dict().values())).hexdigest())
