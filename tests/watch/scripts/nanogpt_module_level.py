"""nanoGPT's train.py at module level (karpathy/nanoGPT, https://github.com/karpathy/nanoGPT/blob/master/train.py):
`X, Y = get_batch('train')` fetched before `while True` and again after each micro-step's forward, `with ctx:`
(bf16 autocast), an @torch.no_grad() estimate_loss that switches model.eval()/train(), `break` past max_iters.
A tiny bigram model on random tokens instead of GPT on a dataset."""
import torch
from torch.nn import functional as F

torch.manual_seed(0)
model = torch.nn.Embedding(16, 16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ctx = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
gradient_accumulation_steps, max_iters, eval_interval = 2, 5, 2


def get_batch(split):
    x = torch.randint(16, (4, 6))
    return x, (x * (1 if split == "train" else 3)) % 16


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(2)
        for k in range(2):
            X, Y = get_batch(split)
            with ctx:
                losses[k] = F.cross_entropy(model(X).float().view(-1, 16), Y.view(-1)).item()
        out[split] = losses.mean()
    model.train()
    return out


X, Y = get_batch("train")
iter_num = 0
while True:
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits = model(X)
            loss = F.cross_entropy(logits.float().view(-1, 16), Y.view(-1))
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps}")
    iter_num += 1
    if iter_num > max_iters:
        break
print(model.weight.sum().item())
