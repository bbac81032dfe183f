"""Continual learning between tasks: elastic weight consolidation as GMvandeVen/continual-learning (e6d795a) writes
it (models/cl/continual_learner.py ``estimate_fisher`` with ``fisher_labels='all'``: the label weights under
``torch.no_grad()``, one backward per label, the Fisher information and the parameters' values kept as buffers;
``ewc_loss`` added to every loss of the next task), and Synaptic Intelligence (``update_importance_estimates``: the
path integral ``W[n].add_(-p.grad * (p.detach() - p_old[n]))`` after each update, ``update_omega`` after each task,
``surrogate_loss``). Correct, each is quiet and bit-identical to its bare loop in every check mode; the mistakes next
to them are told with a fix that trains as the correct loop."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import CarriedGraphError, DoubleBackwardError, GraphGuard, GraphLeakWarning, GraphReuseError

CHECKS = ["always", "auto", "off"]


def data():
    torch.manual_seed(0)
    return [(torch.randn(32, 6) + 2 * t, torch.randint(0, 3, (32,))) for t in range(2)]


def fisher(model, samples, weights_with_graph=False, means_with_graph=False, stored_detached=False):
    """``estimate_fisher`` (labels 'all'); ``weights_with_graph``: the label weights taken outside no_grad;
    ``means_with_graph``: the parameters' values kept with ``p.clone()`` (no detach); ``stored_detached``: the
    Fisher information stored detached."""
    est = {n: p.detach().clone().zero_() for n, p in model.named_parameters()}
    model.eval()
    for x, _ in samples:
        output = model(x)
        if weights_with_graph:
            label_weights = F.softmax(output, dim=1)
        else:
            with torch.no_grad():
                label_weights = F.softmax(output, dim=1)
        for label_index in range(output.shape[1]):
            model.zero_grad()
            F.cross_entropy(output, torch.LongTensor([label_index])).backward(
                retain_graph=label_index + 1 < output.shape[1])
            for n, p in model.named_parameters():
                est[n] += label_weights[0][label_index] * (p.grad.detach() ** 2)
    model.train()
    means = {n: p.clone() if means_with_graph else p.detach().clone() for n, p in model.named_parameters()}
    est = {n: f / len(samples) for n, f in est.items()}
    return {n: f.detach() for n, f in est.items()} if stored_detached else est, means


def train_ewc(check, **mistake):
    """Two tasks of four steps, the Fisher information estimated between them; ``check``: None for the bare loop."""
    tasks, model = data(), nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = GraphGuard(model, opt, check=check) if check else None
    precision = means = None
    for xs, ys in tasks:
        for i in range(4):
            opt.zero_grad()
            loss = F.cross_entropy(model(xs[i * 8:(i + 1) * 8]), ys[i * 8:(i + 1) * 8])
            if precision is not None:
                loss = loss + 50. * sum((precision[n] * (p - means[n]) ** 2).sum()
                                        for n, p in model.named_parameters())
            if guard is None:
                loss.backward()
            else:
                with guard.step():
                    guard.backward(loss)
            opt.step()
        precision, means = fisher(model, [(xs[i:i + 1], ys[i:i + 1]) for i in range(5)], **mistake)
    return model


@pytest.mark.parametrize("check", CHECKS)
def test_ewc_with_the_fisher_information_between_two_tasks_is_quiet_and_bit_identical(check):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = train_ewc(check)
    ref = train_ewc(None)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))


def test_a_fisher_information_weighted_outside_no_grad_is_told_to_be_kept_as_a_constant():
    """Weighted by the model's own probabilities taken with their graph, the Fisher information keeps the graphs of
    the forwards it was estimated from, which its own backwards freed: PyTorch fails at the next task's first
    backward. Retaining them would not do: the next update writes the weights they saved."""
    with pytest.raises(DoubleBackwardError, match=r"\(step 5, loss 'loss'\).*held by `local precision\['0\.weight'\]`"
                                                  r".*To fix: if it is meant as a constant") as caught:
        train_ewc("auto", weights_with_graph=True)
    assert len(caught.value.fixes) == 1 and "store `precision['0.weight'].detach()`" in caught.value.fixes[0]
    fixed = train_ewc(None, weights_with_graph=True, stored_detached=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed.parameters(), train_ewc(None).parameters()))
