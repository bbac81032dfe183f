# textual inversion (huggingface/diffusers, examples/textual_inversion/textual_inversion.py): only the placeholder
# token's embedding trains; after each optimizer step every other row is written back from a copy taken before the
# loop. The copy here is taken with .clone() of the weight (a graph: CloneBackward), not of .data as there.
import torch
from torch import nn

torch.manual_seed(0)
vocab, dim, placeholder = 10, 6, 9
emb = nn.Embedding(vocab, dim)
unet = nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, dim)).requires_grad_(False)
opt = torch.optim.AdamW(emb.parameters(), lr=1e-2, weight_decay=0.0)
orig_embeds_params = emb.weight.clone()
index_no_updates = torch.ones(vocab, dtype=torch.bool)
index_no_updates[placeholder] = False
for step in range(6):
    ids = torch.randint(0, vocab - 1, (4, 3))
    ids[:, 1] = placeholder
    hidden = emb(ids).mean(1)
    noise = torch.randn(4, dim)
    loss = nn.functional.mse_loss(unet(hidden + noise), noise)
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        emb.weight[index_no_updates] = orig_embeds_params[index_no_updates]
    print(f"step {step}: loss {loss.item()!r}")
print(emb.weight.sum().item())
