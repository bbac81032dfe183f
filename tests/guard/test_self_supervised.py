"""Self-supervised and semi-supervised loops with a ``GraphGuard``, as their public sources write them and with the
mistakes their users make. A missing stop-gradient that still trains (SimSiam's `z.detach()`, FixMatch's on the weak
view) is no graph-lifecycle mistake: the guard stays quiet and changes nothing. A teacher that is the student itself
(`teacher = student`, then frozen) leaves the loss without a graph, and the error says why. (DINO's center made with a
graph: tests/watch/scripts/dino_center_without_no_grad.py.)"""
import copy
import functools
import re
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import GraphGuard, NoGraphError

CHECKS = ["always", "auto", "off"]


def run_loop(step, model, opt, check: str | None, steps: int = 4) -> None:
    """``step(i)`` returns the loss of iteration ``i``; back-propagated, then the update: bare (``check`` None) or
    inside a GraphGuard's steps, every warning an error."""
    guard = GraphGuard(model, opt, check=check) if check else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(steps):
            with guard.step() if guard else nullcontext():
                loss = step(i)
                opt.zero_grad()
                guard.backward(loss) if guard else loss.backward()
                opt.step()


def state(*modules) -> list[torch.Tensor]:
    return [t.detach().clone() for m in modules for t in m.state_dict().values()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- SimSiam: facebookresearch/simsiam (a7bc177), simsiam/builder.py, main_simsiam.py --------------------------------
class SimSiam(nn.Module):
    """The 3-layer projector with the encoder's fc bias frozen, the 2-layer predictor, `z.detach()` returned by the
    forward; ``stop_gradient`` False: the targets returned with their graph (lightly-ai/lightly #559,
    PatrickHua/SimSiam #39)."""

    def __init__(self, stop_gradient: bool, dim=8, pred_dim=4):
        super().__init__()
        self.stop_gradient = stop_gradient
        fc = nn.Linear(6, dim)
        self.encoder = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Sequential(
            nn.Linear(6, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU(inplace=True),
            nn.Linear(6, 6, bias=False), nn.BatchNorm1d(6), nn.ReLU(inplace=True),
            fc, nn.BatchNorm1d(dim, affine=False)))
        fc.bias.requires_grad = False
        self.predictor = nn.Sequential(nn.Linear(dim, pred_dim, bias=False), nn.BatchNorm1d(pred_dim),
                                       nn.ReLU(inplace=True), nn.Linear(pred_dim, dim))

    def forward(self, x1, x2):
        z1, z2 = self.encoder(x1), self.encoder(x2)
        p1, p2 = self.predictor(z1), self.predictor(z2)
        return (p1, p2, z1.detach(), z2.detach()) if self.stop_gradient else (p1, p2, z1, z2)


def simsiam(check: str | None, stop_gradient: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = SimSiam(stop_gradient)
    criterion = nn.CosineSimilarity(dim=1)
    opt = torch.optim.SGD([{"params": model.encoder.parameters()}, {"params": model.predictor.parameters()}],
                          lr=0.05, momentum=0.9, weight_decay=1e-4)
    images = [torch.randn(8, 10) for _ in range(4)]

    def step(i):
        x = images[i]
        p1, p2, z1, z2 = model(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
        return -(criterion(p1, z2).mean() + criterion(p2, z1).mean()) * 0.5

    run_loop(step, model, opt, check)
    return state(model)


bare_simsiam = functools.cache(lambda stop_gradient: simsiam(None, stop_gradient))  # the bare loops, run once


@pytest.mark.parametrize("check", CHECKS)
def test_simsiam_with_or_without_its_stop_gradient_is_quiet_and_trains_as_the_bare_loop(check):
    """Without `z.detach()` the gradient also flows through the targets (towards collapse): a different training, not
    a graph kept, freed or reused. The guard cannot tell it from a loss meant so, and says nothing."""
    for stop_gradient in (True, False):
        assert same(simsiam(check, stop_gradient), bare_simsiam(stop_gradient))
    assert not same(bare_simsiam(True), bare_simsiam(False))


# -- FixMatch: kekmodel/FixMatch-pytorch (040be3b), train.py, models/ema.py ------------------------------------------
class ModelEMA:
    """models/ema.py: a deep copy, frozen, moved through its state_dict's tensors under torch.no_grad()."""

    def __init__(self, model, decay):
        self.ema = copy.deepcopy(model)
        self.ema.eval()
        self.decay = decay
        self.param_keys = [k for k, _ in self.ema.named_parameters()]
        self.buffer_keys = [k for k, _ in self.ema.named_buffers()]
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        with torch.no_grad():
            msd, esd = model.state_dict(), self.ema.state_dict()
            for k in self.param_keys:
                model_v = msd[k].detach()
                ema_v = esd[k]
                esd[k].copy_(ema_v * self.decay + (1. - self.decay) * model_v)
            for k in self.buffer_keys:
                esd[k].copy_(msd[k])


def interleave(x, size):
    s = list(x.shape)
    return x.reshape([-1, size] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def de_interleave(x, size):
    s = list(x.shape)
    return x.reshape([size, -1] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def fixmatch(check: str | None, detach: bool) -> list[torch.Tensor]:
    """``detach`` False: `torch.softmax(logits_u_w / T)` without its `.detach()`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    ema_model = ModelEMA(model, 0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    batch_size, mu, T, threshold = 4, 2, 1.0, 0.5
    batches = [(torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,)), torch.randn(batch_size * mu, 6))
               for _ in range(4)]

    def step(i):
        inputs_x, targets_x, inputs_u = batches[i]
        inputs_u_w, inputs_u_s = inputs_u + 0.05 * torch.randn_like(inputs_u), inputs_u + 0.5 * torch.randn_like(inputs_u)
        inputs = interleave(torch.cat((inputs_x, inputs_u_w, inputs_u_s)), 2 * mu + 1)
        logits = de_interleave(model(inputs), 2 * mu + 1)
        logits_x = logits[:batch_size]
        logits_u_w, logits_u_s = logits[batch_size:].chunk(2)
        del logits
        Lx = F.cross_entropy(logits_x, targets_x, reduction='mean')
        pseudo_label = torch.softmax((logits_u_w.detach() if detach else logits_u_w) / T, dim=-1)
        max_probs, targets_u = torch.max(pseudo_label, dim=-1)
        mask = max_probs.ge(threshold).float()
        Lu = (F.cross_entropy(logits_u_s, targets_u, reduction='none') * mask).mean()
        if i:  # the EMA moved after the last update (train.py: after optimizer.step())
            ema_model.update(model)
        return Lx + 1.0 * Lu

    run_loop(step, model, opt, check)
    return state(model, ema_model.ema)


bare_fixmatch = functools.cache(lambda detach: fixmatch(None, detach))


@pytest.mark.parametrize("check", CHECKS)
def test_fixmatch_pseudo_labels_with_or_without_detach_train_alike_and_quietly(check):
    """The pseudo-labels are an argmax and the mask a threshold: neither carries a gradient, so the weak view's
    `.detach()` changes nothing but memory (the weak branch's softmax is kept until the backward). Quiet, bit for bit."""
    for detach in (True, False):
        assert same(fixmatch(check, detach), bare_fixmatch(detach))
    assert same(bare_fixmatch(True), bare_fixmatch(False))


# -- BYOL: lucidrains/byol-pytorch, byol_pytorch/byol_pytorch.py at its first commit (7cb8d79) ----------------------
def byol_first_commit(check: str | None) -> list[torch.Tensor]:
    """The first commit's BYOL: the target encoder deep-copied lazily (its parameters left requiring grad, in the
    optimizer since the mock forward of `__init__` made it), run without torch.no_grad(), the targets `.detach()`ed
    in the symmetric loss; `update_moving_average` assigned its None result to `self.target_encoder` (fixed by
    3bcff65), so the target is a fresh copy of the online encoder at every forward. No EMA at all, yet no graph
    kept, freed or reused: quiet, and as the bare loop."""
    torch.manual_seed(0)

    class BYOL(nn.Module):
        def __init__(self):
            super().__init__()
            self.online_encoder = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
            self.online_predictor = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
            self.target_encoder = None
            self.forward(torch.randn(2, 10))

        def _get_target_encoder(self):
            if self.target_encoder is None:
                self.target_encoder = copy.deepcopy(self.online_encoder)
            return self.target_encoder

        def update_moving_average(self):
            for current, ma in zip(self.online_encoder.parameters(), self.target_encoder.parameters()):
                ma.data = ma.data * 0.99 + 0.01 * current.data
            self.target_encoder = None  # `self.target_encoder = update_moving_average(...)`, which returns None

        def forward(self, x):
            image_one, image_two = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
            online_pred_one = self.online_predictor(self.online_encoder(image_one))
            online_pred_two = self.online_predictor(self.online_encoder(image_two))
            target_encoder = self._get_target_encoder()
            target_proj_one, target_proj_two = target_encoder(image_one), target_encoder(image_two)
            loss_one = 2 - 2 * F.cosine_similarity(online_pred_one, target_proj_two.detach(), dim=-1)
            loss_two = 2 - 2 * F.cosine_similarity(online_pred_two, target_proj_one.detach(), dim=-1)
            return (loss_one + loss_two).mean()

    learner = BYOL()
    opt = torch.optim.Adam(learner.parameters(), lr=3e-3)
    images = [torch.randn(6, 10) for _ in range(4)]

    def step(i):
        if i:
            learner.update_moving_average()
        return learner(images[i])

    run_loop(step, learner, opt, check)
    return state(learner.online_encoder, learner.online_predictor)


@pytest.mark.parametrize("check", CHECKS)
def test_byol_first_commit_target_remade_every_step_is_quiet_and_trains_as_the_bare_loop(check):
    assert same(byol_first_commit(check), byol_first_commit(None))


# -- a teacher that is the student: facebookresearch/dinov2 #407 ----------------------------------------------------
def dino_like(check: str | None, teacher_is_student: bool) -> list[torch.Tensor]:
    """DINO's teacher frozen through `requires_grad` (main_dino.py), assigned `teacher = student` (dinov2 #407) or
    made as the fix says, `copy.deepcopy(student)`; the loss a cross-entropy to the teacher's sharpened output."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(10, 8), nn.GELU(), nn.Linear(8, 6))
    teacher = student if teacher_is_student else copy.deepcopy(student)
    for p in teacher.parameters():
        p.requires_grad = False
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    images = [torch.randn(4, 10) for _ in range(4)]
    guard = GraphGuard(student, opt, check=check) if check else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in images:
            with guard.step() if guard else nullcontext():
                q = F.softmax(teacher(x) / 0.04, dim=-1).detach()
                loss = torch.sum(-q * F.log_softmax(student(x + 0.1 * torch.randn_like(x)) / 0.1, dim=-1), -1).mean()
                opt.zero_grad()
                guard.backward(loss) if guard else loss.backward()
                opt.step()
                with torch.no_grad():
                    for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                        param_k.data.mul_(0.99).add_((1 - 0.99) * param_q.detach().data)
    return state(student, teacher)


@pytest.mark.parametrize("check", ["always", "auto"])
def test_a_teacher_assigned_from_the_student_and_frozen_is_named_and_the_copy_it_advises_trains(check):
    with pytest.raises(NoGraphError, match=re.escape(
            "(all frozen); `student` and `teacher` are one module, not copies: freezing one froze the other")) as err:
        dino_like(check, teacher_is_student=True)
    assert err.value.fixes[0] == ("if `teacher` is meant as a copy (a teacher, a target network), make it one: "
                                  "`teacher = copy.deepcopy(student)`, then freeze it")
    assert same(dino_like(check, teacher_is_student=False), dino_like(None, teacher_is_student=False))
