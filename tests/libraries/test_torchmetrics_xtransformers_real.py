"""Two libraries that sit inside a user's own loop, run from the same seeds:

- torchmetrics 1.9.0: a classifier's loop updating metrics every step (``MeanMetric`` of the loss,
  ``Accuracy(task="multiclass")`` called as ``metric(preds, target)`` for the batch's value, a ``MetricCollection`` of
  accuracy, F1 and AUROC fed ``.update``), each ``.compute()``d and ``.reset()`` per epoch, a validation pass under
  ``torch.no_grad()`` with metrics of its own;
- x-transformers 2.31.10: its enwik8 loop (``train_enwik8.py``: ``TransformerWrapper`` with rotary embeddings in an
  ``AutoregressiveWrapper``, gradient accumulation, ``clip_grad_norm_``, Adam, a validation loss under ``no_grad``,
  ``generate(cache_kv=True)``), its Transformer-XL loop (``train_xl_enwik8.py``: ``XLAutoregressiveWrapper`` over a
  long sequence cut into segments, memories carried between them with ``tbptt_steps=2``), and the README's
  Transformer-XL recurrence by hand (``logits, mems = model(seg, mems=mems, return_mems=True)``) across steps.

Each correct loop runs bare, under ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the
user's script) and with a ``safeloop.GraphGuard`` (``with guard.step()`` around an iteration), in every guard mode, and
as a ``safeloop.Trainer`` (metrics updated in ``training_step`` / ``validation_step``, computed in ``on_epoch_end`` /
``on_validation_end``; the enwik8 loop with ``grad_accum`` and ``grad_clip``): every parameter and buffer, the
optimizer's state and what the loop records (each epoch's metrics, the losses, the samples) bit for bit the same,
with no warning the bare run does not emit.

What torchmetrics keeps (read in ``torchmetrics/metric.py``): ``Metric.update`` runs the metric's update under
``torch.set_grad_enabled(False)``, so ``MeanMetric.update(loss)``'s in-place sums keep no graph, and ``metric(x)``
(``forward``) keeps the batch's value with its graph in ``_forward_cache`` until the next call only: neither is a
mistake, and both run quiet. A list state (``CatMetric``'s ``value``, ``AUROC``'s ``preds``) appends the tensor it is
given, graph and all (no_grad does not detach what is appended): fed ``loss`` or ``logits.softmax(-1)``, every step's
graph stays alive in the metric until ``reset()``. That is warned, naming the state, and the advised ``.detach()``
trains quiet. A Transformer-XL's ``mems`` carried with their graph (``detach_mems=False``) into the next step is
stopped before that step's backward, naming ``mems``.
"""
import contextlib
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from safeloop import GraphGuard, Trainer
from safeloop.errors import CarriedGraphError, GraphLeakWarning
from safeloop.watch import Watch
from tests.libraries.compare import same
from tests.realworld.harness import checks, strict

try:
    import torchmetrics
    from torchmetrics import Accuracy, MetricCollection
    from torchmetrics.aggregation import CatMetric, MeanMetric
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score
except ImportError:
    torchmetrics = None
try:
    import x_transformers
    from x_transformers import Decoder, TransformerWrapper
    from x_transformers.autoregressive_wrapper import AutoregressiveWrapper
    from x_transformers.xl_autoregressive_wrapper import XLAutoregressiveWrapper
except ImportError:
    x_transformers = None

needs_torchmetrics = pytest.mark.skipif(torchmetrics is None, reason="torchmetrics is not installed")
needs_xtransformers = pytest.mark.skipif(x_transformers is None, reason="x-transformers is not installed")


# -- what every case runs -----------------------------------------------------------------------------------------


def three_runs(build, train, check):
    """``train(*build())`` bare, under ``Watch`` (this file as the script) and with ``guard=GraphGuard(check=check)``,
    each from the same seeds; every result is compared with the bare run's, bit for bit, and the guarded runs may warn
    nothing the bare run does not. ``train`` returns a dict whose first value is the trained module. Returns the bare
    run's result."""
    def run(guard=None):
        torch.manual_seed(0)
        built = build()
        torch.manual_seed(1)
        return train(*built, **({} if guard is None else {"guard": guard}))
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = run()
    with strict(own), Watch(GraphGuard(check=check), train.__code__.co_filename):
        watched = run()
    same(watched, ref)
    with strict(own):
        guarded = run(guard=GraphGuard(check=check))
    same(guarded, ref)
    torch.manual_seed(0)
    fresh = build()[0]
    model = next(iter(ref.values()))
    assert any(not torch.equal(p, q) for p, q in zip(model.state_dict().values(), fresh.state_dict().values())), \
        "nothing trained"
    return ref


def ported(build, hand, port, check, steps, **settings):
    """The hand loop ``hand(*build())`` bare, then ``port(model=build()[0], ...)``, a ``safeloop.Trainer`` subclass,
    from the same seeds: the model, the optimizer's state and what the port records (``port.recorded(trainer)``)
    against the hand loop's result past its first two values, bit for bit, with no warning but the hand loop's own."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        built = build()
        torch.manual_seed(1)
        ref = hand(*built)
    with strict(own):
        torch.manual_seed(0)
        built = build()
        torch.manual_seed(1)
        trainer = port(model=built[0], train_data=port.data(built, steps), max_steps=steps, device="cpu",
                       progress=False, loggers=(), **settings)
        trainer.fit()
    assert trainer.state.step == steps
    model, optimizer = list(ref.values())[:2]
    same(trainer.model, model)
    same(trainer.optimizers["optimizer"].state_dict(), optimizer)
    same(port.recorded(trainer), dict(list(ref.items())[2:]))
    return ref


def stepped(guard):
    """``guard.step()``, or nothing without a guard."""
    return guard.step() if guard is not None else contextlib.nullcontext()


def backward(guard, loss):
    return guard.backward(loss) if guard is not None else loss.backward()


# == torchmetrics ====================================================================================================
CLASSES, EPOCHS, BATCHES = 4, 2, 4


class Classifier(nn.Module):

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, CLASSES))

    def forward(self, x):
        return self.net(x)


def classification(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=gen), torch.randint(CLASSES, (16,), generator=gen)) for _ in range(n)]


def metrics_build():
    model = Classifier()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), classification(BATCHES, 3), \
        classification(2, 4)


def collection(prefix=None):
    """Accuracy and macro F1 (one compute group: their states are shared) and AUROC (list states of every batch's
    predictions and targets), fed logits: AUROC's update takes their softmax itself, under no_grad."""
    return MetricCollection({"acc": Accuracy(task="multiclass", num_classes=CLASSES),
                             "f1": MulticlassF1Score(num_classes=CLASSES, average="macro"),
                             "auroc": MulticlassAUROC(num_classes=CLASSES)}, prefix=prefix)


def validate(model, val, val_loss, val_metrics, history):
    """A validation pass as the Trainer's (eval mode, no_grad), its metrics computed and reset at its end."""
    model.eval()
    with torch.no_grad():
        for x, y in val:
            logits = model(x)
            val_loss.update(F.cross_entropy(logits, y))
            val_metrics.update(logits, y)
    history["val"].append({"loss": val_loss.compute(), **val_metrics.compute()})
    val_loss.reset()
    val_metrics.reset()
    model.train()


def feed_loss(mean_loss, loss, feed):
    """``detach``: ``mean_loss.update(loss.detach())``; ``graph``: ``mean_loss.update(loss)`` (its update runs under
    no_grad: the sum keeps no graph); ``forward``: ``mean_loss(loss)`` (the batch's mean, with its graph, kept in
    ``_forward_cache`` until the next call)."""
    if feed == "detach":
        mean_loss.update(loss.detach())
    elif feed == "graph":
        mean_loss.update(loss)
    else:
        mean_loss(loss)


def metrics_loop(model, optimizer, train, val, guard=None, feed="detach", epochs=EPOCHS):
    """The loop of torchmetrics' docs ("Metrics in a training loop"): every step the loss's ``MeanMetric``, the batch
    accuracy from ``accuracy(logits, y)`` (forward), the collection's ``update``; each epoch ``compute()`` and
    ``reset()``; validated before training and after each epoch, as the Trainer port does with ``val_every``."""
    mean_loss, accuracy, metrics = MeanMetric(), Accuracy(task="multiclass", num_classes=CLASSES), collection()
    val_loss, val_metrics = MeanMetric(), collection(prefix="val_")
    history = {"train": [], "val": [], "batch_acc": []}
    validate(model, val, val_loss, val_metrics, history)
    for _epoch in range(epochs):
        for x, y in train:
            with stepped(guard):
                optimizer.zero_grad()
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                backward(guard, loss)
                optimizer.step()
                feed_loss(mean_loss, loss, feed)
                history["batch_acc"].append(accuracy(logits, y))
                metrics.update(logits, y)
        history["train"].append({"loss": mean_loss.compute(), "acc": accuracy.compute(), **metrics.compute()})
        for metric in (mean_loss, accuracy, metrics):
            metric.reset()
        validate(model, val, val_loss, val_metrics, history)
    return {"model": model, "optimizer": optimizer.state_dict(), "history": history}


@needs_torchmetrics
@pytest.mark.parametrize("feed", ["detach", "graph", "forward"])
@pytest.mark.parametrize("check", checks())
def test_metrics_loop(check, feed):
    """Two epochs of 4 steps with SGD and momentum, the metrics of every step and epoch recorded: the same bare,
    watched and guarded, whether the loss's mean is fed ``loss.detach()``, ``loss`` itself or called forward."""
    ref = three_runs(metrics_build, lambda *a, guard=None: metrics_loop(*a, guard=guard, feed=feed), check)
    history = ref["history"]
    assert len(history["train"]) == EPOCHS and len(history["val"]) == EPOCHS + 1
    assert len(history["batch_acc"]) == EPOCHS * BATCHES
    assert history["train"][-1]["loss"] < history["train"][0]["loss"]


if torchmetrics is not None:
    class MetricsTrainer(Trainer):
        """The same loop as a Trainer: the metrics made in ``on_fit_start``, updated in ``training_step`` and
        ``validation_step``, computed and reset in ``on_epoch_end`` and ``on_validation_end``."""
        feed = "detach"

        @staticmethod
        def data(built, steps):
            return built[2]

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

        def on_fit_start(self):
            self.mean_loss, self.accuracy = MeanMetric(), Accuracy(task="multiclass", num_classes=CLASSES)
            self.metrics = collection()
            self.val_loss, self.val_metrics = MeanMetric(), collection(prefix="val_")
            self.history = {"train": [], "val": [], "batch_acc": []}

        def training_step(self, batch):
            x, y = batch
            logits = self.model(x)
            loss = F.cross_entropy(logits, y)
            feed_loss(self.mean_loss, loss, self.feed)
            self.history["batch_acc"].append(self.accuracy(logits, y))
            self.metrics.update(logits, y)
            return loss

        def validation_step(self, batch):
            x, y = batch
            logits = self.model(x)
            loss = F.cross_entropy(logits, y)
            self.val_loss.update(loss)
            self.val_metrics.update(logits, y)
            return loss

        def on_epoch_end(self):
            self.history["train"].append({"loss": self.mean_loss.compute(), "acc": self.accuracy.compute(),
                                          **self.metrics.compute()})
            for metric in (self.mean_loss, self.accuracy, self.metrics):
                metric.reset()

        def on_validation_end(self, metrics):
            self.history["val"].append({"loss": self.val_loss.compute(), **self.val_metrics.compute()})
            self.val_loss.reset()
            self.val_metrics.reset()

        @staticmethod
        def recorded(trainer):
            return {"history": trainer.history}

    class ForwardMetricsTrainer(MetricsTrainer):
        feed = "forward"


@needs_torchmetrics
@pytest.mark.parametrize("port", ["MetricsTrainer", "ForwardMetricsTrainer"])
@pytest.mark.parametrize("check", checks())
def test_metrics_loop_as_a_trainer(check, port):
    """The loop ported, validated with ``val_data`` every epoch (``val_every=4``) and before training: the same
    model, optimizer state and metrics as the hand loop's."""
    port = globals()[port]
    ported(metrics_build, lambda *a: metrics_loop(*a, feed=port.feed), port, check, EPOCHS * BATCHES,
           val_data=classification(2, 4), val_every=BATCHES, guard={"check": check})


@needs_torchmetrics
def test_mean_metric_fed_the_loss_keeps_no_graph():
    """Why ``mean_loss.update(loss)`` is no leak: torchmetrics runs ``update`` with grad disabled, and the sums are
    in place into states made without a graph; ``mean_loss(loss)`` keeps one step's graph in ``_forward_cache``."""
    weight = torch.ones(3, requires_grad=True)
    mean_loss = MeanMetric()
    mean_loss.update((weight * 2).sum())
    assert mean_loss.mean_value.grad_fn is None and mean_loss.weight.grad_fn is None
    batch = mean_loss((weight * 3).sum())
    assert batch.grad_fn is not None and mean_loss._forward_cache is batch and mean_loss.mean_value.grad_fn is None


def kept_loop(model, optimizer, train, _val, guard=None, kind="cat", fix=False):
    """One epoch keeping a graph in a metric's list state every step (the mistake), or the advised ``.detach()``:
    ``cat``: the step's losses in a ``CatMetric`` (``losses.update(loss)``); ``auroc``: an AUROC fed probabilities
    (``auroc.update(logits.softmax(-1), y)``); ``collection``: the same AUROC in a ``MetricCollection``; ``model``: an
    AUROC kept on the model (``model.auroc``, a submodule whose states are no buffers)."""
    losses = CatMetric()
    auroc = MulticlassAUROC(num_classes=CLASSES)
    metrics = MetricCollection({"auroc": MulticlassAUROC(num_classes=CLASSES)})
    model.auroc = MulticlassAUROC(num_classes=CLASSES)
    for x, y in train:
        with stepped(guard):
            optimizer.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            backward(guard, loss)
            optimizer.step()
            probs = logits.softmax(-1).detach() if fix else logits.softmax(-1)
            if kind == "cat":
                losses.update(loss.detach() if fix else loss)
            elif kind == "auroc":
                auroc.update(probs, y)
            elif kind == "collection":
                metrics.update(probs, y)
            else:
                model.auroc.update(probs, y)
    value = {"cat": losses, "auroc": auroc, "collection": metrics, "model": model.auroc}[kind].compute()
    del model.auroc
    return {"model": model, "optimizer": optimizer.state_dict(), "value": value}


KEPT = {"cat": r"losses\.value", "auroc": r"auroc\.preds", "collection": r"metrics\.auroc\.preds",
        "model": r"model\.auroc\.preds"}


@needs_torchmetrics
@pytest.mark.parametrize("kind", list(KEPT))
def test_graph_kept_in_a_metric_state_is_warned_and_detach_trains(kind):
    """A list state keeping each step's graph: a ``GraphLeakWarning`` at step 2 naming the metric's state, with a
    ``GraphGuard`` and under ``watch``; with ``.detach()`` on what it is fed, quiet and bit for bit."""
    pattern = r"steps 1 and 2: the autograd graphs of both steps are still alive, held by `(local )?" + KEPT[kind]
    torch.manual_seed(0)
    built = metrics_build()
    with pytest.warns(GraphLeakWarning, match=pattern):
        kept_loop(*built, guard=GraphGuard(built[0], check="always"), kind=kind)
    torch.manual_seed(0)
    with Watch(GraphGuard(check="always"), __file__), pytest.warns(GraphLeakWarning, match=pattern):
        kept_loop(*metrics_build(), kind=kind)
    three_runs(metrics_build, lambda *a, guard=None: kept_loop(*a, guard=guard, kind=kind, fix=True), "always")
