# SwAV (facebookresearch/swav main_swav.py train): the prototypes normalized in place under torch.no_grad() before
# each forward, the codes of each assigned crop computed by Sinkhorn-Knopp under torch.no_grad() from the detached
# output and, once it is full, a queue of earlier embeddings (shifted and written in place, detached), the swapped
# prediction loss over the other crops, and the prototypes' gradients dropped (p.grad = None) for the first iterations.
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(31)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.projection_head = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        self.prototypes = nn.Linear(4, 5, bias=False)

    def forward(self, inputs):
        x = F.normalize(self.projection_head(torch.cat(inputs)), dim=1, p=2)
        return x, self.prototypes(x)


@torch.no_grad()
def sinkhorn(out, epsilon=0.05, iters=3):
    Q = torch.exp(out / epsilon).t()
    B, K = Q.shape[1], Q.shape[0]
    Q /= torch.sum(Q)
    for _ in range(iters):
        Q /= torch.sum(Q, dim=1, keepdim=True)
        Q /= K
        Q /= torch.sum(Q, dim=0, keepdim=True)
        Q /= B
    Q *= B
    return Q.t()


model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
bs, nmb_crops, crops_for_assign, queue_length = 4, 2, [0, 1], 8
queue = torch.zeros(len(crops_for_assign), queue_length, 4)
use_the_queue = False
loader = [[torch.randn(bs, 6) for _ in range(nmb_crops)] for _ in range(4)]
for it, inputs in enumerate(loader):
    with torch.no_grad():
        w = model.prototypes.weight.data.clone()
        w = F.normalize(w, dim=1, p=2)
        model.prototypes.weight.copy_(w)
    embedding, output = model(inputs)
    embedding = embedding.detach()
    loss = 0
    for i, crop_id in enumerate(crops_for_assign):
        with torch.no_grad():
            out = output[bs * crop_id: bs * (crop_id + 1)].detach()
            if use_the_queue or not torch.all(queue[i, -1, :] == 0):
                use_the_queue = True
                out = torch.cat((torch.mm(queue[i], model.prototypes.weight.t()), out))
            queue[i, bs:] = queue[i, :-bs].clone()
            queue[i, :bs] = embedding[crop_id * bs: (crop_id + 1) * bs]
            q = sinkhorn(out)[-bs:]
        subloss = 0
        for v in [v for v in range(nmb_crops) if v != crop_id]:
            x = output[bs * v: bs * (v + 1)] / 0.1
            subloss -= torch.mean(torch.sum(q * F.log_softmax(x, dim=1), dim=1))
        loss += subloss / (nmb_crops - 1)
    loss /= len(crops_for_assign)
    optimizer.zero_grad()
    loss.backward()
    if it < 2:
        for name, p in model.named_parameters():
            if "prototypes" in name:
                p.grad = None
    optimizer.step()
    print(f"iteration {it}: loss {loss.item()!r} queue used {use_the_queue}")
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest())
