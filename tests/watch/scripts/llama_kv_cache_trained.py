# Meta's llama reference model (meta-llama/llama, llama/model.py) fine-tuned as it is: its Attention writes each
# forward's keys and values into the preallocated cache_k / cache_v (`self.cache_k[:bsz, start_pos:...] = xk`) and
# attends over the cache. Trained from start_pos 0, the caches keep the graph of the last step's write, which the next
# step's loss goes back through (PyTorch: 'backward through the graph a second time' at step 2). The fix detaches both
# caches, keeping their values (llama_kv_cache_detached); the copy an adversarial patch is written into, stored back in
# `self.cache_v`, would keep that graph.
import math

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
max_batch_size, max_seq_len, n_heads, head_dim, vocab = 2, 8, 2, 4, 11
dim = n_heads * head_dim


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.cache_k = torch.zeros((max_batch_size, max_seq_len, n_heads, head_dim))
        self.cache_v = torch.zeros((max_batch_size, max_seq_len, n_heads, head_dim))

    def forward(self, x, start_pos, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, n_heads, head_dim)
        xk = xk.view(bsz, seqlen, n_heads, head_dim)
        xv = xv.view(bsz, seqlen, n_heads, head_dim)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
        keys = self.cache_k[:bsz, : start_pos + seqlen]
        values = self.cache_v[:bsz, : start_pos + seqlen]
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.attention = Attention()
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, start_pos):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
        h = h + self.attention(h, start_pos, mask)
        return self.output(h).float()


model = Transformer()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(4):
    tokens = torch.randint(0, vocab, (max_batch_size, max_seq_len))
    logits = model(tokens[:, :-1], 0)
    loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, repr(loss.item()))
print([p.sum().item() for p in model.parameters()])
