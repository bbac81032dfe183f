"""GPT-2 pre-training with bf16 autocast, accumulation and a per-step lr: karpathy/build-nanogpt at commit
6104ab1b53920f6e2159749676073ff7d815c1fa, train_gpt2.py (``CausalSelfAttention``, ``MLP``, ``Block``, ``GPT``,
``GPT.configure_optimizers``, ``DataLoaderLite``, ``get_lr`` and the training loop).

On a CPU ``device_type`` is ``"cpu"``, so every micro-step's forward runs under
``torch.autocast(device_type="cpu", dtype=torch.bfloat16)`` (bf16 matmuls, ``F.scaled_dot_product_attention(
is_causal=True)``, float32 LayerNorm and cross-entropy); the loss is divided by ``grad_accum_steps`` and
back-propagated outside the region, ``loss_accum += loss.detach()``; then ``clip_grad_norm_(..., 1.0)``, the lr of
both AdamW groups (decay on tensors of two or more dimensions only; ``fused`` off on a CPU) assigned from
``get_lr(step)`` (linear warm-up, cosine decay), and the update. The token embedding and the output layer share
one weight (``self.transformer.wte.weight = self.lm_head.weight``): one parameter reached twice in the graph, once
through an embedding lookup and once through a bf16 matmul.

Changes for a seconds-long test: 2 layers, 2 heads, ``n_embd`` 8, a vocabulary of 32, ``block_size`` 8 (GPT-2's
12, 12, 768, 50304, 1024); micro-batches B=2, T=8 and 2 of them per step (``total_batch_size`` 32; 2**19 tokens),
4 steps with 2 of warm-up (19073 and 715); ``DataLoaderLite`` reads one random token tensor (the FineWeb shards);
no DDP, evaluation, HellaSwag, sampling, logging or checkpoints; the ``master_process`` prints dropped.

The port: ``precision="bf16"``, ``grad_accum=2`` (each loss divided by it, as the loop does), ``grad_clip=1.0``,
the lr assigned in ``on_before_optimizer_step``.
"""
import inspect
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

from safeloop import Trainer

from .harness import checks, compare

B, T, GRAD_ACCUM_STEPS = 2, 8, 2
max_lr = 6e-4
min_lr = max_lr * 0.1
warmup_steps = 2  # 715
max_steps = 4  # 19073
device_type = "cpu"


# -- train_gpt2.py: the model -------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1
        # regularization
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        qkv = self.c_attn(x)
        q, k, v = qkv.split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        # output projection
        y = self.c_proj(y)
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate='tanh')
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        return x


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 8  # 1024
    vocab_size: int = 32  # 50257
    n_layer: int = 2  # 12
    n_head: int = 2  # 12
    n_embd: int = 8  # 768


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        # weight sharing scheme
        self.transformer.wte.weight = self.lm_head.weight

        # init params
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, 'NANOGPT_SCALE_INIT'):
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        # idx is of shape (B, T)
        B, T = idx.size()
        assert T <= self.config.block_size, \
            f"Cannot forward sequence of length {T}, block size is only {self.config.block_size}"
        # forward the token and posisition embeddings
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # shape (T)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (T, n_embd)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (B, T, n_embd)
        x = tok_emb + pos_emb
        # forward the blocks of the transformer
        for block in self.transformer.h:
            x = block(x)
        # forward the final layernorm and the classifier
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # start with all of the candidate parameters (that require grad)
        param_dict = {pn: p for pn, p in self.named_parameters()}
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        # create optim groups. Any parameters that is 2D will be weight decayed, otherwise no.
        # i.e. all weight tensors in matmuls + embeddings decay, all biases and layernorms don't.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        # Create AdamW optimizer and use the fused version if it is available
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=use_fused)
        return optimizer


# -- train_gpt2.py: data and schedule -----------------------------------------------------------------------
class DataLoaderLite:
    """One shard, given as a tensor (the source lists and loads FineWeb shards)."""

    def __init__(self, B, T, tokens):
        self.B = B
        self.T = T
        self.tokens = tokens
        self.reset()

    def reset(self):
        # state, init at shard zero
        self.current_position = 0

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        x = (buf[:-1]).view(B, T)  # inputs
        y = (buf[1:]).view(B, T)  # targets
        # advance the position in the tensor
        self.current_position += B * T
        # if loading the next batch would be out of bounds, advance to next shard
        if self.current_position + (B * T + 1) > len(self.tokens):
            self.current_position = 0
        return x, y


def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    # 2) if it > lr_decay_iters, return min learning rate
    if it > max_steps:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff starts at 1 and goes to 0
    return min_lr + coeff * (max_lr - min_lr)


# -- train_gpt2.py: the loop --------------------------------------------------------------------------------
def gpt_hand(model, train_loader):
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=device_type)
    for step in range(max_steps):
        # do one step of the optimization
        model.train()
        optimizer.zero_grad()
        loss_accum = 0.0
        for micro_step in range(GRAD_ACCUM_STEPS):
            x, y = train_loader.next_batch()
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
                logits, loss = model(x, y)
            # we have to scale the loss to account for gradient accumulation,
            # because the gradients just add on each successive backward().
            # addition of gradients corresponds to a SUM in the objective, but
            # instead of a SUM we want MEAN. Scale the loss here so it comes out right
            loss = loss / GRAD_ACCUM_STEPS
            loss_accum += loss.detach()
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # determine and set the learning rate for this iteration
        lr = get_lr(step)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        optimizer.step()


class GPTTrainer(Trainer):
    def configure_optimizers(self):
        return self.model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=device_type)

    def training_step(self, batch):
        x, y = batch
        logits, loss = self.model(x, y)
        return loss

    def on_before_optimizer_step(self, name, optimizer):
        lr = get_lr(self.state.step)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr


def make_gpt():
    return GPT(GPTConfig())


def tokens():
    return torch.randint(GPTConfig.vocab_size, (B * T * GRAD_ACCUM_STEPS * max_steps + 1,),
                         generator=torch.Generator().manual_seed(11))


class MicroBatches:
    """The hand loop reads ``next_batch()``; the port iterates the same loader's micro-batches."""

    def __init__(self):
        self.loader = DataLoaderLite(B, T, tokens())

    def next_batch(self):
        return self.loader.next_batch()

    def __iter__(self):
        self.loader.reset()
        return iter([self.loader.next_batch() for _ in range(GRAD_ACCUM_STEPS * max_steps)])


@pytest.mark.parametrize("check", checks())
def test_gpt2_with_bf16_autocast_on_cpu_accumulation_and_tied_embeddings(check):
    compare(make_gpt, gpt_hand, GPTTrainer, lambda model: MicroBatches(), check, steps=max_steps,
            precision="bf16", grad_accum=GRAD_ACCUM_STEPS, grad_clip=1.0)


def test_the_embedding_and_the_output_layer_share_one_parameter():
    model = make_gpt()
    assert model.transformer.wte.weight is model.lm_head.weight
