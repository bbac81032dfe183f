"""Weights made anew at each forward or trained sparsely: ``torch.nn.utils.prune`` (a forward pre-hook recomputing
``weight = weight_orig * weight_mask``; iterative pruning with rewinding through ``weight_orig``, then
``prune.remove``), parametrizations registered after the optimizer was built, and embedding tables with sparse
gradients (``nn.Embedding(sparse=True)`` trained by ``torch.optim.SparseAdam`` beside a dense optimizer, gradients
zeroed in place). Correct, each is quiet and bit-identical to its bare loop in every check mode."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, prune

from safeloop import GraphGuard, UnusedGradientWarning

CHECKS = ["always", "auto", "off"]


def steps(guard, model, optimizers, batches, forward):
    for x, y in batches:
        for opt in optimizers:
            opt.zero_grad(set_to_none=False)
        loss = forward(model, x, y)
        if guard is None:
            loss.backward()
        else:
            with guard.step():
                guard.backward(loss)
        for opt in optimizers:
            opt.step()


def classify(model, x, y):
    return F.cross_entropy(model(x), y)


def lottery_ticket(check):
    """Three rounds of global L1 pruning (20%), the surviving weights rewound to their initial values through
    ``weight_orig`` under ``torch.no_grad()``, a new SGD each round, the masks made permanent at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(4)]
    for level in range(3):
        if level:
            prune.global_unstructured([(model[0], "weight"), (model[2], "weight")],
                                      pruning_method=prune.L1Unstructured, amount=0.2)
            with torch.no_grad():
                for i in (0, 2):
                    model[i].weight_orig.copy_(initial[f"{i}.weight"])
                    model[i].bias.copy_(initial[f"{i}.bias"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        steps(GraphGuard(model, opt, check=check) if check else None, model, [opt], batches, classify)
    for i in (0, 2):
        prune.remove(model[i], "weight")
    return model


@pytest.mark.parametrize("check", CHECKS)
def test_pruned_weights_recomputed_by_the_pre_hook_and_rewound_are_quiet_and_bit_identical(check):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = lottery_ticket(check)
    ref = lottery_ticket(None)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    assert (ours[0].weight == 0).sum() > 0


def normalized(check, register):
    """A layer reparametrized by ``register`` after the optimizer was built."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    register(model[0])
    batches = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(4)]
    steps(GraphGuard(model, opt, check=check) if check else None, model, [opt], batches, classify)
    return model


@pytest.mark.parametrize("check", CHECKS)
def test_spectral_norm_registered_after_the_optimizer_trains_the_same_parameter_and_is_quiet(check):
    """``parametrizations.spectral_norm`` keeps the layer's own ``weight`` Parameter as ``original``: the optimizer
    built before still trains it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = normalized(check, parametrizations.spectral_norm)
    ref = normalized(None, parametrizations.spectral_norm)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))


def test_weight_norm_registered_after_the_optimizer_is_warned_naming_its_new_parameters():
    """``parametrizations.weight_norm`` makes two new Parameters (``original0``, ``original1``) that the optimizer
    built before does not hold: the layer keeps its initial weight."""
    with pytest.warns(UnusedGradientWarning, match=r"`model\.0\.parametrizations\.weight\.original0`, "
                                                   r"`model\.0\.parametrizations\.weight\.original1`.*build the "
                                                   r"optimizer after replacing a layer"):
        normalized("auto", parametrizations.weight_norm)


class Recommender(nn.Module):
    """Two embedding tables with sparse gradients and a dense head."""

    def __init__(self):
        super().__init__()
        self.users, self.items = nn.Embedding(20, 4, sparse=True), nn.Embedding(30, 4, sparse=True)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids):
        return self.head(torch.cat([self.users(ids[:, 0]), self.items(ids[:, 1])], dim=1)).squeeze(1)


def recommend(model, x, y):
    return F.binary_cross_entropy_with_logits(model(x), y)


def sparse(check, tables_optimized=True):
    torch.manual_seed(0)
    model = Recommender()
    tables = [*model.users.parameters(), *model.items.parameters()]
    optimizers = [torch.optim.SparseAdam(tables, lr=1e-2)] * tables_optimized
    optimizers.append(torch.optim.Adam(model.head.parameters(), lr=1e-2))
    batches = [(torch.stack([torch.randint(0, 20, (8,)), torch.randint(0, 30, (8,))], 1), torch.rand(8).round())
               for _ in range(5)]
    steps(GraphGuard(model, optimizers, check=check) if check else None, model, optimizers, batches, recommend)
    return model


@pytest.mark.parametrize("check", CHECKS)
def test_sparse_gradients_of_embedding_tables_trained_by_sparse_adam_are_quiet_and_bit_identical(check):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = sparse(check)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), sparse(None).parameters()))


def test_embedding_tables_that_no_optimizer_holds_are_a_part_left_out_of_training_on_purpose():
    """As a dense encoder left requiring grad in a head-only fine-tune: not reported (``unused.py``), sparse or not."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = sparse("always", tables_optimized=False)
    assert model.users.weight.grad.is_sparse
