# watch: --check always
# Adversarial training on embeddings (FGM, Miyato et al.; VAT and FreeLB alike): torch.autograd.grad takes the loss's
# gradient with respect to the embeddings, a non-leaf, which stops there: the embedding's own node does not run and
# keeps its saved tensors for the step's loss, back-propagated through the embeddings once more.
import hashlib

import torch
import torch.nn.functional as F

torch.manual_seed(0)
embed = torch.nn.Embedding(20, 8)
head = torch.nn.Linear(8, 3)
opt = torch.optim.Adam([*embed.parameters(), *head.parameters()], lr=0.01)
data = [(t, t[:, 0] % 3) for t in torch.randint(20, (6, 8, 5))]
for step, (tokens, labels) in enumerate(data):
    emb = embed(tokens)
    grad, = torch.autograd.grad(F.cross_entropy(head(emb.mean(1)), labels), emb)
    adv = emb + 0.5 * grad / (grad.norm() + 1e-12)
    loss = F.cross_entropy(head(emb.mean(1)), labels) + F.cross_entropy(head(adv.mean(1)), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
params = [*embed.parameters(), *head.parameters()]
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest())
