"""FGM adversarial training on embeddings whose adversarial batch is made once, before the loop, from the first
batch, and made again only every fourth step: `adv` keeps the graph of the embedding it was made from, which the
first step's backward frees; bare, the second step fails inside torch."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
embed = torch.nn.Embedding(20, 8)
head = torch.nn.Linear(8, 3)
opt = torch.optim.Adam([*embed.parameters(), *head.parameters()], lr=0.01)
data = [(t, t[:, 0] % 3) for t in torch.randint(20, (6, 8, 5))]


def fgm(tokens, labels, eps=0.5):
    emb = embed(tokens)
    grad, = torch.autograd.grad(F.cross_entropy(head(emb.mean(1)), labels), emb)
    return emb + eps * grad / (grad.norm() + 1e-12)


adv = fgm(*data[0])
for step, (tokens, labels) in enumerate(data):
    if step % 4 == 3:
        adv = fgm(tokens, labels)
    loss = F.cross_entropy(head(embed(tokens).mean(1)), labels) + F.cross_entropy(head(adv.mean(1)), data[0][1])
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
