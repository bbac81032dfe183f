"""A reversible network (lucidrains/reformer-pytorch, reformer_pytorch/reversible.py, reformer_pytorch.py;
examples/enwik8_simple/train.py).

What it exercises: a custom ``autograd.Function`` whose forward runs the blocks under ``no_grad`` and
keeps only its output (``ctx.y``, detached: no ``save_for_backward``), and whose backward rebuilds each
block's input from its output, re-running the blocks under ``enable_grad`` and calling
``torch.autograd.backward`` itself, inside the outer backward, to put the blocks' gradients on their
parameters; dropout replayed in backward from the CPU RNG state recorded in forward (``Deterministic``,
``fork_rng``); the loss back-propagated for each of 4 micro-batches, clipped, then one update.

Changes for a seconds-long test: the blocks' attention replaced by a second feed-forward (the reversible
arithmetic is the same), a 16-token vocabulary, dimension 8, 2 blocks, sequences of 8, two updates.
"""
import pytest
import torch
from torch import nn
from torch.autograd.function import Function
from torch.nn import functional as F

from safeloop import Trainer

from .harness import checks, compare

NUM_TOKENS, DIM, SEQ, GRADIENT_ACCUMULATE_EVERY, UPDATES = 16, 8, 8, 4, 2


class Deterministic(nn.Module):
    """The source's, CPU only (it also records and sets CUDA RNG states)."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.cpu_state = None

    def record_rng(self, *args):
        self.cpu_state = torch.get_rng_state()

    def forward(self, *args, record_rng=False, set_rng=False, **kwargs):
        if record_rng:
            self.record_rng(*args)
        if not set_rng:
            return self.net(*args, **kwargs)
        with torch.random.fork_rng(devices=[], enabled=True):
            torch.set_rng_state(self.cpu_state)
            return self.net(*args, **kwargs)


class ReversibleBlock(nn.Module):
    def __init__(self, f, g):
        super().__init__()
        self.f = Deterministic(f)
        self.g = Deterministic(g)

    def forward(self, x, f_args={}, g_args={}):
        x1, x2 = torch.chunk(x, 2, dim=2)
        with torch.no_grad():
            y1 = x1 + self.f(x2, record_rng=self.training, **f_args)
            y2 = x2 + self.g(y1, record_rng=self.training, **g_args)
        return torch.cat([y1, y2], dim=2)

    def backward_pass(self, y, dy, f_args={}, g_args={}):
        y1, y2 = torch.chunk(y, 2, dim=2)
        del y
        dy1, dy2 = torch.chunk(dy, 2, dim=2)
        del dy

        with torch.enable_grad():
            y1.requires_grad = True
            gy1 = self.g(y1, set_rng=True, **g_args)
            torch.autograd.backward(gy1, dy2)

        with torch.no_grad():
            x2 = y2 - gy1
            del y2, gy1
            dx1 = dy1 + y1.grad
            del dy1
            y1.grad = None

        with torch.enable_grad():
            x2.requires_grad = True
            fx2 = self.f(x2, set_rng=True, **f_args)
            torch.autograd.backward(fx2, dx1, retain_graph=True)

        with torch.no_grad():
            x1 = y1 - fx2
            del y1, fx2
            dx2 = dy2 + x2.grad
            del dy2
            x2.grad = None
            x = torch.cat([x1, x2.detach()], dim=2)
            dx = torch.cat([dx1, dx2], dim=2)
        return x, dx


class _ReversibleFunction(Function):
    @staticmethod
    def forward(ctx, x, blocks, kwargs):
        ctx.kwargs = kwargs
        for block in blocks:
            x = block(x, **kwargs)
        ctx.y = x.detach()
        ctx.blocks = blocks
        return x

    @staticmethod
    def backward(ctx, dy):
        y = ctx.y
        kwargs = ctx.kwargs
        for block in ctx.blocks[::-1]:
            y, dy = block.backward_pass(y, dy, **kwargs)
        return dy, None, None


class ReversibleSequence(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList([ReversibleBlock(f, g) for f, g in blocks])

    def forward(self, x, **kwargs):
        return _ReversibleFunction.apply(x, self.blocks, {"f_args": {}, "g_args": {}})


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


def feed_forward(dropout=0.1):
    return nn.Sequential(nn.Linear(DIM, DIM * 2), nn.GELU(), nn.Dropout(dropout), nn.Linear(DIM * 2, DIM))


class ReversibleLM(nn.Module):
    """ReformerLM's path (token and position embeddings, the input doubled for the two halves, the
    halves averaged) under the AutoregressiveWrapper's loss (each token predicts the next)."""

    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(NUM_TOKENS, DIM)
        self.pos_emb = nn.Embedding(SEQ, DIM)
        self.layers = ReversibleSequence([(PreNorm(DIM, feed_forward()), PreNorm(DIM, feed_forward()))
                                          for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, NUM_TOKENS)

    def forward(self, x):
        xi, xo = x[:, :-1], x[:, 1:]
        h = self.token_emb(xi) + self.pos_emb(torch.arange(xi.shape[1]))
        h = torch.cat([h, h], dim=-1)
        h = self.layers(h)
        h = torch.stack(h.chunk(2, dim=-1)).mean(dim=0)
        return F.cross_entropy(self.out(self.norm(h)).transpose(1, 2), xo)


def sequences(model):
    gen = torch.Generator().manual_seed(6)
    return [torch.randint(NUM_TOKENS, (4, SEQ + 1), generator=gen) for _ in range(GRADIENT_ACCUMULATE_EVERY * UPDATES)]


def reversible_hand(model, data):
    """examples/enwik8_simple/train.py's loop."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_loader = iter(data)
    for i in range(UPDATES):
        model.train()
        for __ in range(GRADIENT_ACCUMULATE_EVERY):
            loss = model(next(train_loader))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optim.step()
        optim.zero_grad()


class Reversible(Trainer):
    """A step per micro-batch; every 4th updates (clipped by the Trainer: grad_clip=0.5)."""

    automatic = False

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def training_step(self, batch):
        loss = self.model(batch)
        self.backward(loss)
        if self.state.step % GRADIENT_ACCUMULATE_EVERY == GRADIENT_ACCUMULATE_EVERY - 1:
            self.step()
        return loss


@pytest.mark.parametrize("check", checks())
def test_reversible_network_with_a_hand_written_backward(check):
    compare(ReversibleLM, reversible_hand, Reversible, sequences, check, steps=GRADIENT_ACCUMULATE_EVERY * UPDATES,
            grad_clip=0.5)
