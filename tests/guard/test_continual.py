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

from safeloop import CarriedGraphError, DoubleBackwardError, GraphGuard, GraphLeakWarning, GraphReuseError, Trainer

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


def test_means_kept_with_their_graph_are_stopped_before_the_penalty_trains_nothing():
    """``p.clone()`` without ``.detach()``: the penalty's gradient through the kept values cancels its gradient
    through the parameters, so EWC silently does nothing; the graph, used by every step of the next task, is stopped
    with the fix for a value the loss compares with (made under ``torch.no_grad()``)."""
    with pytest.raises(CarriedGraphError, match=r"the loss reaches CloneBackward0.*held by `local means\[.*To fix: if "
                                                r"it is a target the loss compares with.*compute it under "
                                                r"`torch.no_grad\(\)`"):
        train_ewc("auto", means_with_graph=True)


def train_si(check, p_detached=True, steps=4):
    """Synaptic Intelligence over two tasks; ``p_detached``: the path integral made from ``p.detach()`` as the
    source has it (else from ``p``, with its graph)."""
    tasks, model = data(), nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = GraphGuard(model, opt, check=check) if check else None
    prev = {n: p.detach().clone() for n, p in model.named_parameters()}
    omega = None
    for xs, ys in tasks:
        W = {n: p.data.clone().zero_() for n, p in model.named_parameters()}
        p_old = {n: p.data.clone() for n, p in model.named_parameters()}
        for i in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(model(xs[i * 8:(i + 1) * 8]), ys[i * 8:(i + 1) * 8])
            if omega is not None:
                loss = loss + 10. * sum((omega[n] * (p - prev[n]) ** 2).sum() for n, p in model.named_parameters())
            if guard is None:
                loss.backward()
            else:
                with guard.step():
                    guard.backward(loss)
            opt.step()
            for n, p in model.named_parameters():
                W[n].add_(-p.grad * ((p.detach() if p_detached else p) - p_old[n]))
                p_old[n] = p.detach().clone()
        current = {n: p.detach().clone() for n, p in model.named_parameters()}
        omega = {n: (0 if omega is None else omega[n]) + W[n] / ((current[n] - prev[n]) ** 2 + 0.1) for n in W}
        prev = current
    return model


@pytest.mark.parametrize("check", CHECKS)
def test_synaptic_intelligence_is_quiet_and_bit_identical(check):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = train_si(check)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), train_si(None).parameters()))


def test_a_path_integral_made_with_the_graph_of_the_parameters_is_warned_as_it_grows():
    """``W[n].add_(-p.grad * (p - p_old[n]))``: each update adds to the graph of W, which no loss of the task uses:
    named, with the write under ``torch.no_grad()`` as the fix (the same values as ``p.detach()``)."""
    with pytest.warns(GraphLeakWarning, match=r"`local W\['0\.weight'\]`.*To fix: make that write under "
                                              r"`torch.no_grad\(\)`"):
        with pytest.raises(CarriedGraphError):
            train_si("always", p_detached=False)


def test_the_omega_made_from_a_path_integral_with_its_graph_is_told_to_have_it_written_under_no_grad():
    """At the next task's first step the loss reaches omega, made from W's grown graph (W itself made anew for the
    task): detaching omega at the end of each step would still train that step through W's graph, so the first fix is
    the write into W, which then trains as the correct loop."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphLeakWarning)
        with pytest.raises(CarriedGraphError, match=r"\(step 5, loss 'loss'\).*held by `local omega\[.*To fix: make "
                                                    r"the writes that grew its graph under `torch.no_grad\(\)` "
                                                    r"\(or from `p.detach\(\)`\)"):
            train_si("auto", p_detached=False)


class EWCTrainer(Trainer):
    """Each task a ``fit`` of its own, the penalty added in ``training_step``."""

    fisher_info = means = None

    def training_step(self, batch):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if self.fisher_info is not None:
            loss = loss + 50. * sum((self.fisher_info[n] * (p - self.means[n]) ** 2).sum()
                                    for n, p in self.model.named_parameters())
        return loss


def test_in_a_trainer_the_fisher_information_with_its_freed_graph_is_stopped_before_any_gradient_changes():
    """Estimated between two fits: built before the second fit's first step, its graph already freed by the
    estimate's own backwards (said so), kept as a constant first."""
    tasks, model = data(), nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    fisher_info = means = None
    with pytest.raises(GraphReuseError, match=r"\(step 1, loss 'loss'\).*held by `self\.fisher_info\[.*an earlier "
                                              r"backward already freed its saved tensors.*To fix: if it is meant as a "
                                              r"constant"):
        for xs, ys in tasks:
            trainer = EWCTrainer(model=model, train_data=[(xs[i * 8:(i + 1) * 8], ys[i * 8:(i + 1) * 8])
                                                          for i in range(4)], max_steps=4, device="cpu",
                                 optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), progress=False, loggers=())
            trainer.fisher_info, trainer.means = fisher_info, means
            trainer.fit()
            fisher_info, means = fisher(model, [(xs[i:i + 1], ys[i:i + 1]) for i in range(5)],
                                        weights_with_graph=True)
    assert all(p.grad is None for p in model.parameters())
