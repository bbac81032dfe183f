"""Each mistake of docs/guard.md's table on the paths a Trainer step takes besides one loss in automatic mode: a dict
of losses, in sequential backwards (the first retained) and summed; manual mode with one optimizer and with two (a
GAN's step: the discriminator's update, then the generator's loss through it); gradient accumulation. Each is caught
at the step the table says, naming its holder and its fix; a failed step leaves parameters and optimizer state as the
last update left them, or says which parameters the step itself wrote through `.data`; the mistake's correct twin is
quiet on the same path. The states of its carried-fix paragraph (a namedtuple, a dict, a list the loss is built from,
a sum of losses, an adversarial patch written into the batches of train_data) and MoCo's queue read without a copy run
with one loss in automatic mode too: tests/guard and tests/watch cover them in plain loops only."""
import copy
import re
import warnings
from collections import namedtuple
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from safeloop import (CarriedGraphError, DoubleBackwardError, GraphLeakWarning, GraphReuseError,
                      InplaceModificationError, NoGraphError, Trainer, UnusedGradientWarning)

# the paths besides one loss in automatic mode, whose every mistake tests/seeds and tests/guard cover already; manual
# mode with one optimizer where they do not (``COVERED``)
PATHS = ["dict", "sum", "manual", "two", "accum"]
COVERED = {("carried", "manual"), ("ctx", "manual"), ("data", "manual"), ("nograd", "manual"),
           ("leak", "manual"), ("unused", "manual")}
# with one loss in automatic mode too: the states of the carried-fix paragraph, MoCo's queue, an adversarial patch
ONE_TOO = {"namedtuple", "dict", "list", "summed", "queue", "patch", "patch_once"}


class CtxLinear(torch.autograd.Function):
    """Keeps its input on ctx as an attribute rather than with save_for_backward: PyTorch checks no version."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.x, ctx.weight = x, weight
        return x.mm(weight.t())

    @staticmethod
    def backward(ctx, grad):
        return grad.mm(ctx.weight), grad.t().mm(ctx.x)


State = namedtuple("State", "h c")


class Net(nn.Module):
    """A generator ``g`` and a discriminator ``d``, each a Linear(4, 4); ``extra``: layers added to ``d`` (a
    plain list of them is the unused-gradient mistake)."""

    def __init__(self, extra=nn.ModuleList):
        super().__init__()
        self.g, self.d = nn.Linear(4, 4), nn.Linear(4, 4)
        self.extra = extra([nn.Linear(4, 4)]) if extra is not None else []

    def disc(self, z):
        return sum((layer(z) for layer in self.extra), self.d(z))

    def forward(self, x):
        return self.disc(self.g(x))


class Paths(Trainer):
    """``mistake`` written in the loss (the generator's, on the path ``two``) or fixed (``fixed``)."""

    path, mistake, fixed = "one", None, False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.h, self.total, self.x0 = torch.zeros(3, 4), torch.zeros(()), torch.randn(3, 4)
        self.pre = torch.tanh(self.model.g(self.x0))  # the reuse mistake: a graph made before training
        self.ema = copy.deepcopy(self.model).requires_grad_(False)
        self.kept = []  # (parameters, optimizer states) after each update
        self.saved, self.sum_loss = [], 0  # the losses the loss is built from, and their sum, kept across steps
        self.st = State(torch.zeros(3, 4), torch.zeros(3, 4))
        self.mhx = {"h": torch.zeros(3, 4), "m": torch.zeros(3, 4)}
        self.queue = torch.randn(4, 6)  # MoCo's queue of keys, enqueued into in place every step

    def configure_optimizers(self):
        def sgd(params):
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if self.path != "two":
            return sgd(self.model.parameters())
        extra = self.model.extra.parameters() if isinstance(self.model.extra, nn.Module) else ()  # a list: none
        return {"d": sgd([*self.model.d.parameters(), *extra]), "g": sgd(self.model.g.parameters())}

    def loss(self, batch):
        """The loss, and a tensor of its graph that a second loss can share."""
        mistake, fixed, model = self.mistake, self.fixed, self.model
        if mistake == "reuse":
            pre = torch.tanh(model.g(self.x0)) if fixed else self.pre
            out = model(batch)
            return (out * pre).pow(2).mean(), out
        if mistake == "carried":
            out = model(batch)
            self.h = torch.tanh(out + self.h)
            loss = self.h.pow(2).mean()
            if fixed:
                self.h = self.h.detach()
            return loss, out
        if mistake == "namedtuple":  # an LSTM's state as a namedtuple, detached through its own class
            out = model(batch)
            h = torch.tanh(out + self.st.h)
            self.st = State(h, self.st.c + h)
            loss = self.st.c.pow(2).mean()
            if fixed:
                self.st = State(*(t.detach() for t in self.st))
            return loss, out
        if mistake == "dict":  # a memory network's state as a dict, detached in place
            out = model(batch)
            self.mhx["h"] = torch.tanh(out + self.mhx["h"])
            self.mhx["m"] = self.mhx["m"] + self.mhx["h"]
            loss = self.mhx["m"].pow(2).mean()
            if fixed:
                self.mhx.update({k: v.detach() for k, v in self.mhx.items()})
            return loss, out
        if mistake in ("list", "summed"):  # the loss built from a list never emptied, or a sum never started again
            if fixed:  # after the last backward
                del self.saved[:]
                self.sum_loss = 0
            out = model(batch)
            if mistake == "list":  # one loss per row, as REINFORCE keeps one log-prob per time step of an episode
                self.saved.extend(row.pow(2).mean() for row in out)
                return torch.stack(self.saved).mean(), out
            self.sum_loss = self.sum_loss + out.pow(2).mean()
            return self.sum_loss, out
        if mistake == "queue":  # read as it is, then enqueued into before the backward (moco's _dequeue_and_enqueue)
            out = model(batch)
            loss = out.mm(self.queue.clone() if fixed else self.queue).pow(2).mean()
            with torch.no_grad():
                self.queue[:, 0] = out[0]
            return loss, out
        if mistake in ("patch", "patch_once"):  # written into each batch of train_data, read again or once
            if fixed:
                batch = batch.clone()
            batch[:, :2] = torch.tanh(model.g.bias[:2])
            out = model(batch)
            return out.pow(2).mean(), out
        if mistake == "ctx":
            h = model.g(batch)
            if fixed:
                h = h + CtxLinear.apply(h, model.d.weight)
            else:
                h += CtxLinear.apply(h, model.d.weight)
            return h.pow(2).mean(), h
        if mistake == "data":  # weight clipping through .data after the forward that saved them
            if fixed:
                self.clip()
            out = model(batch)
            loss = out.pow(2).mean()
            if not fixed:
                self.clip()
            return loss, out
        if mistake == "nograd":
            with torch.enable_grad() if fixed else torch.no_grad():
                out = model(batch)
                return out.pow(2).mean(), out
        if mistake == "inplace":
            out = model(batch)
            s = torch.sigmoid(out)
            loss = s.pow(2).mean()
            if fixed:
                s = s * 2
            else:
                s.mul_(2)
            return loss, out
        if mistake == "ema":
            out = model(batch)
            return out.pow(2).mean() + (out - self.ema(batch)).pow(2).mean(), out
        out = model(batch)  # leak, double, unused: in training_step
        loss = out.pow(2).mean()
        if mistake == "leak":
            self.total = self.total + (loss.detach() if fixed else loss)
        return loss, out

    def clip(self):
        for p in self.model.parameters():
            p.data.clamp_(-0.3, 0.3)

    def training_step(self, batch):
        double = self.mistake == "double" and not self.fixed
        if self.path == "two":
            fake = self.model.g(batch)
            d_loss = self.model.disc(fake.detach()).pow(2).mean()
            self.backward(d_loss, "d")
            self.step("d")
            g_loss, _ = self.loss(batch)
            self.backward(g_loss, "g")
            if double:
                self.backward(g_loss, "g")
            self.step("g")
            return {"d": d_loss, "g": g_loss}
        loss, out = self.loss(batch)
        if self.path == "manual":
            self.backward(loss)
            if double:
                self.backward(loss)
            self.step()
            return loss
        if double:
            loss.backward(retain_graph=True)
        if self.path in ("dict", "sum"):  # a second loss on the same graph: the first backward retains it
            return {"main": loss, "aux": out.abs().mean()}
        return loss

    def on_step_end(self, losses):
        if self.mistake == "ema":
            with torch.no_grad() if self.fixed else nullcontext():
                for e, p in zip(self.ema.parameters(), self.model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
        self.kept.append(self.snapshot())

    def snapshot(self):
        return ([p.detach().clone() for p in self.model.parameters()],
                [copy.deepcopy(o.state_dict()) for o in self.optimizers.values()])


def trainer(path, mistake, fixed, steps=3, check="auto", base=None):
    torch.manual_seed(0)
    cls = type("Manual" if path in ("manual", "two") else "Automatic", (base or Paths,), {
        "path": path, "mistake": mistake, "fixed": fixed, "automatic": path not in ("manual", "two")})
    data = [torch.randn(3, 4) for _ in range(8)]
    if mistake == "patch":  # read again at step 2: a second epoch
        data = data[:2 if path == "accum" else 1]
    return cls(model=Net(list if mistake == "unused" and not fixed else nn.ModuleList), train_data=data,
               max_steps=steps, grad_accum=2 if path == "accum" else 1, multi_loss="sum" if path == "sum" else
               "sequential", guard={"check": check}, device="cpu", progress=False, loggers=())


def same(a, b):
    return (all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
            and all(str(x) == str(y) for x, y in zip(a[1], b[1])))  # optimizer states: tensors printed whole


AUTOMATIC_TWICE = (re.escape("gradients were already present when training_step returned: training_step (or a hook) "
                             "called backward itself"), re.escape("To fix: return the loss from training_step"))
MANUAL_TWICE = (r"this loss \(PowBackward0\) was already back-propagated by the backward of '(loss|g)' in this step",
                re.escape("To fix: call self.backward once on each loss: delete the second"))
CARRIED = (r"held by `self\.h`",
           re.escape("To fix: detach the carried state at the end of each step (`self.h = self.h.detach()`)"))
# mistake: (error, step (a dict: by path, 2 elsewhere), (what it names, its fix) (a dict: by path), check)
ERRORS = {
    "reuse": (GraphReuseError, 1, (r"held by `self\.pre`",
                                   re.escape("To fix: recompute `self.pre` inside training_step")), "auto"),
    "double": (DoubleBackwardError, 1, {"dict": AUTOMATIC_TWICE, "sum": AUTOMATIC_TWICE, "accum": AUTOMATIC_TWICE,
                                        "manual": MANUAL_TWICE, "two": MANUAL_TWICE}, "auto"),
    # under grad_accum=2 carried from the first micro-batch of step 1 to the second, whose backward freed it
    "carried": (CarriedGraphError, {"accum": 1}, {**dict.fromkeys(PATHS, CARRIED), "accum": (
        re.escape("graph carried over from an earlier micro-batch (step 1") + ".*" +
        re.escape("made by an earlier micro-batch of this step and held by `self.h`, whose backward already freed"),
        re.escape("To fix: detach the carried state at the end of each training_step (`self.h = self.h.detach()`)"))},
                "auto"),
    "namedtuple": (CarriedGraphError, {"accum": 1}, (r"held by `self\.st(\[\d\])?`", re.escape(
        "(`self.st = type(self.st)(*(t.detach() for t in self.st))`)")), "auto"),
    "dict": (CarriedGraphError, {"accum": 1}, (r"held by `self\.mhx\['\w'\]`", re.escape(
        "(`self.mhx.update({k: v.detach() for k, v in self.mhx.items()})`)")), "auto"),
    # detaching what is added would leave the loss without its graph; detaching the sum would keep adding old losses
    "list": (CarriedGraphError, {"accum": 1}, (r"held by `self\.saved\[\d\]`", re.escape(
        "To fix: empty `self.saved` after each backward (`del self.saved[:]`): the loss is built from it")), "auto"),
    "summed": (CarriedGraphError, {"accum": 1}, (r"held by `self\.sum_loss`", re.escape(
        "To fix: start the sum again after each backward (`self.sum_loss = 0`)")), "auto"),
    "queue": (InplaceModificationError, 1, (re.escape("`self.queue` or a view of it) was changed in place"), re.escape(
        "To fix: read a copy of `self.queue` where the step uses it (`self.queue.clone()`")), "auto"),
    # written into in place by the step that read it, its gradient going through the write: cloned before, not detached
    "patch": (CarriedGraphError, 2, (r"the loss reaches CopySlices, created during an earlier step and held by `batch`",
                                     re.escape("To fix: write into a copy: clone the tensor before writing into it")),
              "auto"),
    "ctx": (InplaceModificationError, 1, (re.escape("keeps a tensor made in the step as an attribute of its ctx "
                                                    "(`ctx.x`)"), re.escape("`x = x + 1` rather than `x += 1`")),
            "auto"),
    # the critic's weights clipped after its forward; with two optimizers seen at the generator's backward of step 1
    "data": (InplaceModificationError, {"two": 1}, (r"whose graph saved .*`self\.model\.d\.weight`",
                                                    re.escape("To fix: write them before the forward that uses them")),
             "always"),
    "nograd": (NoGraphError, 1, (re.escape("it was computed under torch.no_grad()"),
                                 re.escape("To fix: compute the loss outside torch.no_grad()")), "auto"),
    "inplace": (InplaceModificationError, 1, (re.escape("the output of Mul) was changed in place"),
                                              re.escape("To fix: use the out-of-place form")), "auto"),
    "ema": (CarriedGraphError, 2, (r"the graph of the parameter `self\.ema\.g\.weight`",
                                   re.escape("To fix: make that write under `torch.no_grad()`")), "auto"),
}


def cells(table):
    return [(m, p) for m in sorted(table) for p in [*PATHS, *["one"][:m in ONE_TOO]] if (m, p) not in COVERED]


@pytest.mark.parametrize("mistake, path", cells(ERRORS))
def test_a_mistake_stops_its_step_on_every_path_and_the_fix_is_quiet(mistake, path):
    error, step, said, check = ERRORS[mistake]
    step = step.get(path, 2) if isinstance(step, dict) else step
    named, fix = said[path] if isinstance(said, dict) else said
    wrong = trainer(path, mistake, fixed=False, check=check)
    before = wrong.snapshot()
    with warnings.catch_warnings(record=True) as warned, pytest.raises(error, match=f"(?s){named}.*{fix}") as caught:
        warnings.simplefilter("always")
        wrong.fit()
    assert caught.value.step == step and len(wrong.kept) == step - 1
    if mistake == "data":  # written through .data by the step itself: said to stay so
        assert re.search(r"The step was abandoned \(parameters and optimizer state are unchanged; "
                         r"but `model\.\w+\.weight`.* and stay changed\)", str(caught.value)), str(caught.value)
    else:  # as the last update left them
        assert "The step was abandoned (parameters and optimizer state are unchanged)" in str(caught.value)
        assert same(wrong.snapshot(), wrong.kept[-1] if wrong.kept else before)
    leaks = [str(w.message) for w in warned if w.category is GraphLeakWarning]
    if mistake == "ema":  # its graph, said as it piles up after step 1
        assert len(leaks) == 1 and "(step 1): the parameters `self.ema.g.weight`" in leaks[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(path, mistake, fixed=True, check=check).fit()


WARNINGS = {
    "leak": (GraphLeakWarning, 2, r"steps 1 and 2: .* held by `self\.total`",
             re.escape("Store loss.item() or loss.detach() instead of the loss tensor")),
    "unused": (UnusedGradientWarning, 1, re.escape("the loss reaches `self.model.extra[0].weight`"),
               re.escape("To fix: keep layers in an nn.ModuleList")),
    "patch_once": (GraphLeakWarning, 2, r"steps 1 and 2: .* held by `self\.train_data\[\d\]`",
                   re.escape("To fix: write into a copy: clone the tensor before writing into it")),
}


@pytest.mark.parametrize("mistake, path", cells(WARNINGS))
def test_a_warned_mistake_is_said_on_every_path_and_the_fix_is_quiet(mistake, path):
    category, step, named, fix = WARNINGS[mistake]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer(path, mistake, fixed=False).fit()
    said = [w.message for w in said if w.category is category]
    assert len(said) == 1 and said[0].step == step and re.search(f"(?s){named}.*{fix}", str(said[0])), said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(path, mistake, fixed=True).fit()


class KeepsOneStepLonger(Paths):
    """The step's losses, summed with their graphs, kept until the step after the next begins: never two steps'
    graphs at once, though the two backwards (or the two losses) of one step are kept together."""

    def on_step_start(self):
        self.previous, self.losses = getattr(self, "losses", None), 0

    def training_step(self, batch):
        out = super().training_step(batch)
        self.losses = self.losses + (sum(out.values()) if isinstance(out, dict) else out)
        return out


@pytest.mark.parametrize("path", PATHS)
def test_the_graphs_of_one_step_kept_one_step_longer_are_no_leak(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(path, None, False, check="always", base=KeepsOneStepLonger).fit()


class QueueInModel(Paths):
    """MoCo's queue a buffer of the model, which the copy made for the EMA duplicates: deep-copied, at version 1, as
    the step's enqueue leaves the model's."""

    def __init__(self, **kwargs):
        kwargs["model"].register_buffer("queue", torch.randn(4, 6))
        super().__init__(**kwargs)

    def training_step(self, batch):
        out = self.model(batch)
        loss = out.mm(self.model.queue).pow(2).mean()
        with torch.no_grad():
            self.model.queue[:, 0] = out[0]
        return loss


def test_a_queue_that_a_deep_copy_of_the_model_duplicates_is_named():
    with pytest.raises(InplaceModificationError, match=re.escape(
            "To fix: read a copy of `self.model.queue` where the step uses it (`self.model.queue.clone()`")):
        trainer("one", None, False, base=QueueInModel).fit()
