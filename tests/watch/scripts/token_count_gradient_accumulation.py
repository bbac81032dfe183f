"""Gradient accumulation normalised by the tokens of the whole accumulation group, as transformers' Trainer does
since its fix (huggingface/transformers, trainer.py: get_batch_samples counts num_items_in_batch over all the
micro-batches of an update before any forward; loss/loss_utils.py: ForCausalLMLoss sums the token losses with
reduction="sum" and divides by num_items_in_batch), in a hand-written loop: padded labels at -100, the running
loss kept as `tr_loss += loss.detach()`, clipping, step, zero_grad. A 2-layer GPT on random token ids."""
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


def ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100):
    logits = logits.float()
    labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits, shift_labels = logits.view(-1, vocab_size), shift_labels.view(-1)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = nn.functional.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


def train_dataloader():
    for _ in range(8):
        input_ids = torch.randint(0, vocab, (2, block))
        labels = input_ids.clone()
        labels[0, torch.randint(2, block, ()):] = -100
        yield {"input_ids": input_ids, "labels": labels}


def get_batch_samples(epoch_iterator, num_batches):
    batch_samples = [next(epoch_iterator) for _ in range(num_batches)]
    num_items_in_batch = sum((batch["labels"].ne(-100)).sum() for batch in batch_samples)
    return batch_samples, num_items_in_batch


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
gradient_accumulation_steps, tr_loss = 4, torch.tensor(0.0)
epoch_iterator = iter(train_dataloader())
for update_step in range(2):
    batch_samples, num_items_in_batch = get_batch_samples(epoch_iterator, gradient_accumulation_steps)
    for inputs in batch_samples:
        logits = model(inputs["input_ids"])
        loss = ForCausalLMLoss(logits, inputs["labels"], vocab, num_items_in_batch=num_items_in_batch)
        loss.backward()
        tr_loss += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    print(update_step, num_items_in_batch.item(), repr(tr_loss.item()), repr(grad_norm.item()))
print([p.sum().item() for p in model.parameters()])
