"""Training tricks that add forward/backward passes, edit the batch or edit gradients, in a plain loop under
``GraphGuard`` or ``watch`` in process: FreeLB's ascent steps on a perturbation of the embeddings (zhuchen03/FreeLB,
run_glue_freelb.py), PGD's attack written into the embedding weight through ``.data`` (xiangking/ark-nlp, attack.py;
the mistake of its issue #46), PGD adversarial training on images (locuslab/robust_overfitting, train_cifar.py),
CutMix's patch written into the batch in place (clovaai/CutMix-PyTorch, train.py), and adaptive gradient clipping as
an optimizer wrapper that never ran ``Optimizer.__init__`` (vballoli/nfnets-pytorch, agc.py). The watch scripts
``freelb_*``, ``pgd_*``, ``rdrop_two_forwards`` and ``nfnets_agc_wrapper`` run such loops verbatim.
"""
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import GraphGuard
from safeloop.errors import DoubleBackwardError
from safeloop.watch import Watch


def embedder():
    torch.manual_seed(0)
    emb, head = nn.Embedding(20, 8), nn.Linear(8, 3)
    data = [(torch.randint(20, (4, 6)), torch.randint(3, (4,))) for _ in range(3)]
    return emb, head, torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1), data


def freelb(embeds_again: bool, retain: bool, check: str | None):
    """FreeLB's step: K ascent steps on ``delta`` (a fresh leaf each), each back-propagating ``loss / K``; the
    embeddings computed again after each (``embeds_again``) or once, with ``retain_graph=True``."""
    emb, head, opt, data = embedder()
    guard = GraphGuard(emb, opt, check=check) if check else None
    backward = guard.backward if guard else (lambda loss, **kw: loss.backward(**kw))
    for tokens, labels in data:
        embeds_init = emb(tokens)
        delta = torch.zeros_like(embeds_init).uniform_(-0.1, 0.1).detach()
        for astep in range(3):
            delta.requires_grad_()
            loss = F.cross_entropy(head(torch.tanh(delta + embeds_init).mean(1)), labels) / 3
            backward(loss, retain_graph=retain)
            if astep == 2:
                break
            delta_grad = delta.grad.clone().detach()
            delta = (delta + 0.1 * delta_grad / delta_grad.norm().clamp(min=1e-8)).detach()
            if embeds_again:
                embeds_init = emb(tokens)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in [*emb.parameters(), *head.parameters()]]


def test_freelb_embeddings_computed_once_per_step_are_told_to_be_retained_first():
    with pytest.raises(DoubleBackwardError, match=r"the loss reaches EmbeddingBackward0, held by `local embeds_init`.*"
                                                  r"To fix: pass retain_graph=True"):
        freelb(False, False, "always")


@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_freelb_retaining_the_embeddings_graph_trains_as_computing_them_again(check):
    """Nothing updates the parameters between the ascent steps: the first fix trains bit for bit as the source."""
    source = freelb(True, False, None)
    for ours in (freelb(False, True, check), freelb(True, False, check)):
        assert all(torch.equal(p, q) for p, q in zip(ours, source, strict=True))


def pgd(fresh: bool, data_add_only: bool = False):
    """ark-nlp's PGD after the clean backward: the embedding weight moved through `.data` (projected by assigning
    ``param.data``, or with ``param.data.add_`` alone as FGM does), the adversarial loss from a fresh forward or, as
    issue #46 wrote it, from the clean forward's ``outputs``."""
    emb, head, opt, data = embedder()
    guard = GraphGuard(emb, opt, check="always")
    for tokens, labels in data:
        with guard.step():
            outputs = head(torch.tanh(emb(tokens)).mean(1))
            guard.backward(F.cross_entropy(outputs, labels))
            backup = emb.weight.data.clone()
            emb.weight.data.add_(0.3 * emb.weight.grad / emb.weight.grad.norm())
            if not data_add_only:
                emb.weight.data = backup + (emb.weight.data - backup).clamp(-1, 1)
            logits = head(torch.tanh(emb(tokens)).mean(1))
            guard.backward(F.cross_entropy(logits if fresh else outputs, labels))
            emb.weight.data = backup
            opt.step()
            opt.zero_grad()


def test_a_pgd_loss_on_the_clean_outputs_after_a_data_write_is_told_to_forward_again_not_to_retain():
    """Autograd sees no write through `.data`: ``retain_graph=True`` would run this backward on the values from
    before the attack, the clean loss's gradient again (what issue #50 of ark-nlp did)."""
    with pytest.raises(DoubleBackwardError, match=r"held by `local outputs`.*`emb.weight` under that graph were "
                                                  r"written through `.data`.*To fix: compute `outputs` again after "
                                                  r"the change \(a fresh forward\)"):
        pgd(False)
    pgd(True)


@pytest.mark.xfail(strict=True, reason="a write through `.data` in place (FGM's `param.data.add_(r_at)`) moves "
                   "neither the version counter nor the data's address, and the fingerprints are not taken at the "
                   "first step: the error advises retain_graph=True first")
def test_a_loss_on_the_clean_outputs_after_an_in_place_data_write_is_told_to_forward_again():
    with pytest.raises(DoubleBackwardError, match=r"written through `.data`.*To fix: compute `outputs` again"):
        pgd(False, data_add_only=True)


class AGC(torch.optim.Optimizer):
    """nfnets-pytorch's wrapper, trimmed: no ``Optimizer.__init__``; unit-wise clipping in place, then ``optim.step``."""

    def __init__(self, params, optim, clipping=1e-2, eps=1e-3):
        self.optim, self.agc_params, self.eps, self.clipping = optim, [{"params": list(params)}], eps, clipping
        self.param_groups, self.state = optim.param_groups, optim.state

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.agc_params:
            for p in group['params']:
                param_norm = torch.max(p.detach().norm(dim=-1, keepdim=True), torch.tensor(self.eps))
                grad_norm = p.grad.detach().norm(dim=-1, keepdim=True)
                max_norm = param_norm * self.clipping
                clipped_grad = p.grad * (max_norm / torch.max(grad_norm, torch.tensor(1e-6)))
                p.grad.detach().data.copy_(torch.where(grad_norm > max_norm, clipped_grad, p.grad))
        return self.optim.step(closure)


@pytest.mark.parametrize("check", [None, "always", "off"])
def test_an_agc_wrapper_is_followed_through_the_optimizer_it_steps(check):
    def run(check):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = AGC(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.5))
        guard = GraphGuard(model, opt, check=check) if check else None
        for _ in range(3):
            loss = model(torch.randn(8, 4)).square().mean()
            opt.optim.zero_grad()
            guard.backward(loss) if guard else loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    bare = run(None)
    assert all(torch.equal(p, q) for p, q in zip(run(check or "auto"), bare, strict=True))


def watched(run, check):
    """``run()`` bare (``check`` None), or under ``watch`` in process with every warning an error."""
    if check is None:
        return run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Watch(GraphGuard(check=check), __file__):
            return run()


def clamp(X, lower_limit, upper_limit):
    return torch.max(torch.min(X, upper_limit), lower_limit)


def robust_overfitting():
    """train_cifar.py's PGD training: the attack's backwards reach the model's parameters too (cleared by the
    training step's ``opt.zero_grad()``), ``delta`` written through ``.data`` at an index and its gradient zeroed in
    place; the loss's L1 term added in place; then a clean forward with its graph, for the logged accuracy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    epsilon, alpha, upper_limit, lower_limit = 8 / 255, 2 / 255, 1, 0
    train_loss = 0
    for X, y in [(torch.rand(4, 3, 6, 6), torch.randint(3, (4,))) for _ in range(3)]:
        delta = torch.zeros_like(X)
        delta.uniform_(-epsilon, epsilon)
        delta = clamp(delta, lower_limit - X, upper_limit - X)
        delta.requires_grad = True
        for _ in range(2):
            output = model(X + delta)
            index = slice(None, None, None)
            loss = F.cross_entropy(output, y)
            loss.backward()
            grad = delta.grad.detach()
            d = delta[index, :, :, :]
            g = grad[index, :, :, :]
            x = X[index, :, :, :]
            d = torch.clamp(d + alpha * torch.sign(g), min=-epsilon, max=epsilon)
            d = clamp(d, lower_limit - x, upper_limit - x)
            delta.data[index, :, :, :] = d
            delta.grad.zero_()
        delta = delta.detach()
        robust_output = model(torch.clamp(X + delta[:X.size(0)], min=lower_limit, max=upper_limit))
        robust_loss = F.cross_entropy(robust_output, y)
        for name, param in model.named_parameters():
            if 'bias' not in name:
                robust_loss += 5e-4 * param.abs().sum()
        opt.zero_grad()
        robust_loss.backward()
        opt.step()
        output = model(X)
        loss = F.cross_entropy(output, y)
        train_loss += loss.item() * y.size(0)
    return [p.detach().clone() for p in model.parameters()], train_loss


@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_pgd_adversarial_training_on_images_is_quiet_and_unchanged(check):
    bare, ours = robust_overfitting(), watched(robust_overfitting, check)
    assert ours[1] == bare[1] and all(torch.equal(p, q) for p, q in zip(ours[0], bare[0], strict=True))


def rand_bbox(size, lam, rng):
    W, H = size[2], size[3]
    cut_rat = np.sqrt(1. - lam)
    cut_w, cut_h = int(W * cut_rat), int(H * cut_rat)
    cx, cy = rng.integers(W), rng.integers(H)
    return (np.clip(cx - cut_w // 2, 0, W), np.clip(cy - cut_h // 2, 0, H), np.clip(cx + cut_w // 2, 0, W),
            np.clip(cy + cut_h // 2, 0, H))


def cutmix():
    """CutMix's step, over a list of batches read for two epochs: the patch of a permuted batch written into the
    input in place (it needs no grad), the loss mixed by the pixel ratio."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    train_loader = [(torch.rand(4, 3, 6, 6), torch.randint(3, (4,))) for _ in range(3)]
    for epoch in range(2):
        for i, (input, target) in enumerate(train_loader):
            lam = rng.beta(1.0, 1.0)
            rand_index = torch.randperm(input.size()[0])
            target_a = target
            target_b = target[rand_index]
            bbx1, bby1, bbx2, bby2 = rand_bbox(input.size(), lam, rng)
            input[:, :, bbx1:bbx2, bby1:bby2] = input[rand_index, :, bbx1:bbx2, bby1:bby2]
            lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (input.size()[-1] * input.size()[-2]))
            output = model(input)
            loss = criterion(output, target_a) * lam + criterion(output, target_b) * (1. - lam)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_cutmix_writing_a_patch_into_the_batch_is_quiet_and_unchanged(check):
    assert all(torch.equal(p, q) for p, q in zip(watched(cutmix, check), cutmix(), strict=True))
