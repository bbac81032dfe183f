# R-Drop (dropreg/R-Drop, README.md's usage): the same batch forwarded twice with dropout on, the cross entropy of
# both and the symmetric KL between them, each KL term's padded positions zeroed in place (`masked_fill_` on
# kl_div's own output, which its backward does not need) before the sums.
import hashlib

import torch
import torch.nn.functional as F
from torch import nn


def compute_kl_loss(p, q, pad_mask=None):
    p_loss = F.kl_div(F.log_softmax(p, dim=-1), F.softmax(q, dim=-1), reduction='none')
    q_loss = F.kl_div(F.log_softmax(q, dim=-1), F.softmax(p, dim=-1), reduction='none')
    # pad_mask is for seq-level tasks
    if pad_mask is not None:
        p_loss.masked_fill_(pad_mask, 0.)
        q_loss.masked_fill_(pad_mask, 0.)
    p_loss = p_loss.sum()
    q_loss = q_loss.sum()
    loss = (p_loss + q_loss) / 2
    return loss


torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(20, 8), nn.Dropout(0.3), nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.3),
                      nn.Linear(8, 5))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
alpha = 0.5
data = [(torch.randint(1, 20, (4, 6)), torch.randint(5, (4, 6)), torch.randint(3, 7, (4, 1))) for _ in range(6)]
model.train()
for step, (x, label, lengths) in enumerate(data):
    pad_mask = (torch.arange(6) >= lengths).unsqueeze(-1)
    # keep dropout and forward twice
    logits = model(x)
    logits2 = model(x)
    # cross entropy loss for classifier
    ce_loss = 0.5 * (F.cross_entropy(logits.view(-1, 5), label.view(-1))
                     + F.cross_entropy(logits2.view(-1, 5), label.view(-1)))
    kl_loss = compute_kl_loss(logits, logits2, pad_mask)
    loss = ce_loss + alpha * kl_loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item()!r}")
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
