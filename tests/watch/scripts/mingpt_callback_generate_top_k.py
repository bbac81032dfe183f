"""minGPT's chargpt project (karpathy/minGPT, projects/chargpt/chargpt.py: batch_end_callback samples with
model.generate under torch.no_grad() every few iterations, model.eval() then model.train(); mingpt/trainer.py's run:
model.zero_grad(set_to_none=True), clipping, callbacks after the step; mingpt/model.py's generate: cropped context,
top-k masking written in place, multinomial sampling). A 2-layer GPT on random characters."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
vocab, dim, block = 16, 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, do_sample=False, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= block else idx[:, -block:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, top_k)
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            if do_sample:
                idx_next = torch.multinomial(probs, num_samples=1)
            else:
                _, idx_next = torch.topk(probs, k=1, dim=-1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx




class Trainer:
    def __init__(self, model):
        self.model, self.callbacks, self.iter_num = model, [], 0
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.95))

    def add_callback(self, callback):
        self.callbacks.append(callback)

    def run(self, max_iters=6):
        model = self.model
        model.train()
        while True:
            x = torch.randint(0, vocab, (4, block))
            y = torch.roll(x, -1, dims=1)
            logits, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self.optimizer.step()
            for callback in self.callbacks:
                callback(self)
            self.iter_num += 1
            if self.iter_num >= max_iters:
                break


def batch_end_callback(trainer):
    print(f"iter {trainer.iter_num}: train loss {trainer.loss.item():.5f}")
    if trainer.iter_num % 2 == 0:
        model.eval()
        with torch.no_grad():
            context = torch.tensor([[1, 2, 3]])
            y = model.generate(context, 6, temperature=1.0, do_sample=True, top_k=10)[0]
            print(y.tolist())
        model.train()


model = GPT()
trainer = Trainer(model)
trainer.add_callback(batch_end_callback)
trainer.run()
print([p.sum().item() for p in model.parameters()])
