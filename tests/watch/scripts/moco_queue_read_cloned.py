# MoCo's queue of keys read as facebookresearch/moco's builder.py reads it: a copy (`self.queue.clone().detach()`),
# so that enqueueing into the queue in place before the backward leaves the tensor the einsum saved unchanged.
import torch
import torch.nn as nn
import torch.nn.functional as F


class MoCo(nn.Module):
    def __init__(self, dim=8, K=16):
        super().__init__()
        self.encoder_q, self.encoder_k = nn.Linear(10, dim), nn.Linear(10, dim)
        for q, k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            k.data.copy_(q.data)
            k.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
        self.K = K

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        ptr = int(self.queue_ptr)
        self.queue[:, ptr:ptr + keys.shape[0]] = keys.T
        self.queue_ptr[0] = (ptr + keys.shape[0]) % self.K

    def forward(self, im_q, im_k):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / 0.07
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        self._dequeue_and_enqueue(k)
        return logits, labels


torch.manual_seed(0)
model = MoCo()
opt = torch.optim.SGD(model.encoder_q.parameters(), lr=0.03)
for step in range(3):
    x = torch.randn(4, 10)
    output, target = model(x, x + 0.1 * torch.randn_like(x))
    loss = F.cross_entropy(output, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"{loss.item():.6f}")
