"""Embedding models, many with sparse gradients, with a ``GraphGuard`` and through ``Watch`` in process:

- skip-gram word2vec with negative sampling: Andras7/word2vec-pytorch (36b93a5), word2vec/model.py (``SkipGramModel``:
  two ``nn.Embedding(sparse=True)``, the context one looked up twice) and word2vec/trainer.py (``train``: a new
  ``optim.SparseAdam`` and ``CosineAnnealingLR`` each pass, the scheduler stepped before the update, the running loss
  through ``loss.item()``);
- TransE: mklimasz/TransE-PyTorch (80e2545), model.py (the entity table renormalized through ``.data`` at the start of
  each forward, ``MarginRankingLoss(reduction='none')``) and main.py (corrupted triples drawn with ``torch.where``, SGD,
  ``loss.mean().backward()``, the loss read back through ``loss.data.cpu()``);
- RotatE and DistMult: DeepGraphLearning/KnowledgeGraphEmbedding (2e440e0), codes/model.py (``KGEModel.train_step``:
  head- and tail-batch negatives in turn, self-adversarial weights detached, the L3 regularization over the whole
  tables) and codes/run.py (Adam, made again with a tenth of the learning rate at the warm-up step);
- DLRM's ``nn.EmbeddingBag(mode="sum", sparse=True)`` tables beside a dense MLP (facebookresearch/dlrm,
  dlrm_s_pytorch.py), here with a ``SparseAdam`` for the tables and an ``Adam`` for the rest.

Sizes shrunk, data random. A sparse gradient (a COO tensor, uncoalesced as backward leaves it) must neither crash the
checks nor change what is trained; each mistake is told with its tensor and a fix that, applied, trains as the correct
loop. The watch scripts ``word2vec_skip_gram_sparse_adam.py`` and ``kge_rotate_self_adversarial.py`` run the first
and third loops as their sources write them."""
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import GraphGuard, GraphLeakWarning, GraphReuseError, InplaceModificationError, Trainer, \
    UnusedGradientWarning
from safeloop.watch import Watch

MODES = ["always", "auto", "off"]


def quiet(fn, check, **kwargs):
    """``fn`` run with a GraphGuard of ``check``, every warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(guard=check, **kwargs)


def watched(fn, check: str, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Watch(GraphGuard(check=check), __file__):
            return fn(**kwargs)


def same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# -- Andras7/word2vec-pytorch ----------------------------------------------------------------------------------------

class SkipGramModel(nn.Module):
    """word2vec/model.py, as written."""

    def __init__(self, emb_size, emb_dimension):
        super(SkipGramModel, self).__init__()
        self.emb_size = emb_size
        self.emb_dimension = emb_dimension
        self.u_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)
        self.v_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)

        initrange = 1.0 / self.emb_dimension
        nn.init.uniform_(self.u_embeddings.weight.data, -initrange, initrange)
        nn.init.constant_(self.v_embeddings.weight.data, 0)

    def forward(self, pos_u, pos_v, neg_v):
        emb_u = self.u_embeddings(pos_u)
        emb_v = self.v_embeddings(pos_v)
        emb_neg_v = self.v_embeddings(neg_v)

        score = torch.sum(torch.mul(emb_u, emb_v), dim=1)
        score = torch.clamp(score, max=10, min=-10)
        score = -F.logsigmoid(score)

        neg_score = torch.bmm(emb_neg_v, emb_u.unsqueeze(2)).squeeze()
        neg_score = torch.clamp(neg_score, max=10, min=-10)
        neg_score = -torch.sum(F.logsigmoid(-neg_score), dim=1)

        return torch.mean(score + neg_score)


def word_batches(n=4):
    gen = torch.Generator().manual_seed(6)
    return [(torch.randint(10, (6,), generator=gen), torch.randint(10, (6,), generator=gen),
             torch.randint(10, (6, 3), generator=gen)) for _ in range(n)]


def skip_gram(guard=None, mistake=None):
    """``Word2VecTrainer.train``: two passes over four batches. ``mistake``: "no zero_grad" (never cleared), "zeros"
    (``zero_grad(set_to_none=False)``: correct), "accumulated" (two batches a step, one update after both: correct),
    "running loss with graph" (``loss`` for ``loss.item()``), "running loss fixed" (its fix as written)."""
    torch.manual_seed(0)
    skip_gram_model = SkipGramModel(10, 4)
    guard = GraphGuard(skip_gram_model, check=guard) if guard else None
    step_of = guard.step if guard else torch.enable_grad
    dataloader = word_batches()
    losses = []
    for iteration in range(2):
        optimizer = torch.optim.SparseAdam(skip_gram_model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, len(dataloader))
        running_loss = 0.0
        for i, (pos_u, pos_v, neg_v) in enumerate(dataloader):
            with step_of():
                if mistake != "accumulated" or i % 2 == 0:
                    with warnings.catch_warnings():  # the scheduler stepped before the update, as the source does
                        warnings.simplefilter("ignore", UserWarning)
                        scheduler.step()
                if mistake == "zeros":
                    optimizer.zero_grad(set_to_none=False)
                elif mistake != "no zero_grad" and (mistake != "accumulated" or i % 2 == 0):
                    optimizer.zero_grad()
                loss = skip_gram_model.forward(pos_u, pos_v, neg_v)
                guard.backward(loss) if guard else loss.backward()
                if mistake != "accumulated" or i % 2 == 1:
                    optimizer.step()
                if mistake == "running loss with graph":
                    running_loss = running_loss * 0.9 + loss * 0.1
                elif mistake == "running loss fixed":
                    running_loss = running_loss * 0.9 + loss.item() * 0.1
                else:
                    running_loss = running_loss * 0.9 + loss.item() * 0.1
                losses.append(loss.item())
    return losses, flat(skip_gram_model)


@pytest.mark.parametrize("check", MODES)
def test_skip_gram_with_sparse_embeddings_trains_as_without_the_guard(check):
    bare = skip_gram()
    assert same(quiet(skip_gram, check), bare)
    assert same(watched(skip_gram, check), bare)


@pytest.mark.parametrize("check", MODES)
@pytest.mark.parametrize("mistake", ["zeros", "accumulated"])
def test_sparse_gradients_zeroed_in_place_or_accumulated_over_two_batches_are_no_mistake(check, mistake):
    assert same(quiet(skip_gram, check, mistake=mistake), skip_gram(mistake=mistake))


@pytest.mark.parametrize("check", ["always", "auto"])
def test_sparse_gradients_never_cleared_are_said_not_crashed_on(check):
    """Each backward adds a sparse gradient to the one SparseAdam applied (uncoalesced: the sum of both lookups):
    read through its coalesced values, which ``ne`` can take."""
    bare = skip_gram(mistake="no zero_grad")
    with pytest.warns(UnusedGradientWarning, match=r"\(step 4, loss 'loss'\).*nothing cleared them since"):
        with Watch(GraphGuard(check=check), __file__):
            assert same(skip_gram(mistake="no zero_grad"), bare)
