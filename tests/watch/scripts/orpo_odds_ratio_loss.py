"""ORPO's loss (xfactlab/orpo, src/orpo_trainer.py: compute_logps, compute_loss): no reference model; the NLL of the
chosen sequence plus alpha times the log-sigmoid of the log odds ratio of the chosen and rejected sequences' mean
token log-probabilities (bfloat16 mask, float64 mean, the loss cast to bfloat16 before backward), as its Trainer
subclass computes it; a plain loop instead of the Trainer, a 2-layer GPT on random token ids."""
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

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


pad = 0


def compute_logps(prompt_attention_mask, chosen_inputs, chosen_attention_mask, logits):
    mask = chosen_attention_mask[:, :-1] - prompt_attention_mask[:, 1:]
    per_token_logps = torch.gather(logits[:, :-1, :].log_softmax(-1), dim=2,
                                   index=(mask * chosen_inputs[:, 1:]).unsqueeze(2)).squeeze(2)
    return torch.mul(per_token_logps, mask.to(dtype=torch.bfloat16)).sum(dim=1).to(dtype=torch.float64) / mask.sum(
        dim=1).to(dtype=torch.float64)


def get_batch(prompt_len=3):
    pos, neg = torch.randint(1, vocab, (4, block)), torch.randint(1, vocab, (4, block))
    neg[:, :prompt_len] = pos[:, :prompt_len]
    pos[:2, -2:], neg[2:, -1:] = pad, pad
    attention_mask = torch.zeros(4, block, dtype=torch.long)
    attention_mask[:, :prompt_len] = 1
    return {"attention_mask": attention_mask, "positive_input_ids": pos, "positive_attention_mask": (pos != pad).long(),
            "negative_input_ids": neg, "negative_attention_mask": (neg != pad).long()}


def model_loss(model, input_ids, labels):
    logits = model(input_ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100), logits


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
alpha = 0.1
for step in range(5):
    inputs = get_batch()
    neg_labels = inputs["negative_input_ids"].clone()
    pos_labels = inputs["positive_input_ids"].clone()
    neg_labels[neg_labels == pad] = -100
    pos_labels[pos_labels == pad] = -100
    _, neg_logits = model_loss(model, inputs["negative_input_ids"], neg_labels)
    pos_loss, pos_logits = model_loss(model, inputs["positive_input_ids"], pos_labels)
    pos_prob = compute_logps(prompt_attention_mask=inputs["attention_mask"], chosen_inputs=inputs["positive_input_ids"],
                             chosen_attention_mask=inputs["positive_attention_mask"], logits=pos_logits)
    neg_prob = compute_logps(prompt_attention_mask=inputs["attention_mask"], chosen_inputs=inputs["negative_input_ids"],
                             chosen_attention_mask=inputs["negative_attention_mask"], logits=neg_logits)
    log_odds = (pos_prob - neg_prob) - (torch.log(1 - torch.exp(pos_prob)) - torch.log(1 - torch.exp(neg_prob)))
    sig_ratio = torch.nn.functional.sigmoid(log_odds)
    ratio = torch.log(sig_ratio)
    loss = torch.mean(pos_loss - alpha * ratio).to(dtype=torch.bfloat16)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, repr(loss.item()), torch.mean(ratio).item(), torch.mean(log_odds).item())
print([p.sum().item() for p in model.parameters()])
