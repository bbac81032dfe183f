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
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Adam
from torch.utils.data import DataLoader, Dataset

from safeloop import GraphGuard, Trainer
from safeloop.errors import CarriedGraphError, GraphLeakWarning
from safeloop.watch import Watch
from tests.libraries.compare import same, stepped, three_runs
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
def backward(guard, loss):
    """``guard.backward(loss)``, or ``loss.backward()`` without a guard: here, in this file, as the loops are (the guard
    names the tensor at fault by the variables of the function that calls it)."""
    return guard.backward(loss) if guard is not None else loss.backward()


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


@needs_torchmetrics
def test_graph_kept_in_a_metric_state_is_advised_at_the_call_the_user_writes():
    """The advice names what the user hands the metric, not the library's append."""
    torch.manual_seed(0)
    built = metrics_build()
    with pytest.warns(GraphLeakWarning) as caught:
        kept_loop(*built, guard=GraphGuard(built[0], check="always"), kind="auroc")
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert leak.fixes[0].startswith("detach the tensors the loop hands to `auroc` where it calls it"), leak.fixes
    assert "auroc.preds.append" not in str(leak)


# == x-transformers ==================================================================================================
NUM_TOKENS, SEQ_LEN, BATCH_SIZE, GRADIENT_ACCUMULATE_EVERY, NUM_BATCHES = 64, 16, 2, 2, 4
VALIDATE_EVERY, GENERATE_EVERY, GENERATE_LENGTH = 2, 3, 6


def cycle(loader):
    while True:
        for data in loader:
            yield data


class TextSamplerDataset(Dataset):
    """train_enwik8.py's: a random window of the byte stream per item, its start drawn from torch's generator."""

    def __init__(self, data, seq_len):
        super().__init__()
        self.data = data
        self.seq_len = seq_len

    def __getitem__(self, index):
        rand_start = torch.randint(0, self.data.size(0) - self.seq_len - 1, (1,))
        full_seq = self.data[rand_start: rand_start + self.seq_len + 1].long()
        return full_seq

    def __len__(self):
        return self.data.size(0) // self.seq_len


def enwik8_stream(seed):
    """Random bytes below ``NUM_TOKENS`` in place of enwik8."""
    return torch.randint(NUM_TOKENS, (1000,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def enwik8_build(seq_len=SEQ_LEN, **position):
    """train_enwik8.py's model at a tiny size (dim 32, depth 2, 2 heads; the source: 512, 6, 8), rotary embeddings
    (or ``position``), and its loaders over random bytes."""
    model = AutoregressiveWrapper(TransformerWrapper(
        num_tokens=NUM_TOKENS, max_seq_len=SEQ_LEN, use_abs_pos_emb=False,  # (rotary turns it off itself)
        attn_layers=Decoder(dim=32, depth=2, heads=2, **(position or {"rotary_pos_emb": True}))))
    train_loader = cycle(DataLoader(TextSamplerDataset(enwik8_stream(5), seq_len), batch_size=BATCH_SIZE,
                                    drop_last=True))
    val_dataset = TextSamplerDataset(enwik8_stream(6), seq_len)
    val_loader = cycle(DataLoader(val_dataset, batch_size=BATCH_SIZE, drop_last=True))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), train_loader, val_loader, val_dataset


def enwik8_loop(model, optim, train_loader, val_loader, val_dataset, guard=None, num_batches=NUM_BATCHES,
                evaluate=True):
    """train_enwik8.py's loop (the prints and wandb kept as lists), a step per iteration with a guard; the samples of
    ``generate(prompts, seq_len, cache_kv=True)`` (under no_grad, eval mode, a kv cache) recorded."""
    record = {"loss": [], "valid_loss": [], "samples": []}
    for i in range(num_batches):
        with stepped(guard):
            model.train()

            for __ in range(GRADIENT_ACCUMULATE_EVERY):
                loss = model(next(train_loader))
                backward(guard, loss / GRADIENT_ACCUMULATE_EVERY)

            record["loss"].append(loss.item())

            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optim.step()
            optim.zero_grad()

        if evaluate and i % VALIDATE_EVERY == 0:
            model.eval()
            with torch.no_grad():
                loss = model(next(val_loader))
                record["valid_loss"].append(loss.item())

        if evaluate and i % GENERATE_EVERY == 0:
            model.eval()
            inp = val_dataset[0][:-1]
            record["samples"].append(model.generate(prompts=inp, seq_len=GENERATE_LENGTH, cache_kv=True))
    return {"model": model, "optimizer": optim.state_dict(), **record}


@needs_xtransformers
@pytest.mark.parametrize("check", checks())
def test_enwik8_loop(check):
    """train_enwik8.py: 4 updates of 2 accumulated micro-batches, clipped at 0.5, a validation loss every 2 and a
    sample every 3 iterations (nucleus-free default sampling, a kv cache)."""
    ref = three_runs(enwik8_build, enwik8_loop, check)
    assert len(ref["samples"]) == 2 and ref["samples"][0].shape == (GENERATE_LENGTH,)


@needs_xtransformers
def test_enwik8_loop_with_alibi():
    """ALiBi in place of rotary embeddings: its bias made by the first forward and kept as a buffer
    (``register_buffer('bias', ...)``, made from its slopes, no graph), read by every later forward and by the kv
    cache's decoding: quiet."""
    ref = three_runs(lambda: enwik8_build(alibi_pos_bias=True), enwik8_loop, "always")
    assert any(name.endswith("rel_pos.bias") for name, _ in ref["model"].named_buffers())


if x_transformers is not None:
    class Enwik8(Trainer):
        """train_enwik8.py as a Trainer: ``training_step`` is ``self.model(batch)``; ``grad_accum`` and ``grad_clip``
        do the accumulation and the clipping."""

        @staticmethod
        def data(built, steps):
            train_loader = built[2]
            return [next(train_loader) for _ in range(steps * GRADIENT_ACCUMULATE_EVERY)]

        def configure_optimizers(self):
            return torch.optim.Adam(self.model.parameters(), lr=1e-3)

        def on_fit_start(self):
            self.losses = []

        def training_step(self, batch):
            loss = self.model(batch)
            self.last = loss.item()  # the loop prints the last micro-batch's loss (the Trainer's: their mean)
            return loss

        def on_step_end(self, losses):
            self.losses.append(self.last)

        @staticmethod
        def recorded(trainer):
            return {"loss": trainer.losses}


def enwik8_hand(*built):
    out = enwik8_loop(*built, evaluate=False)  # (its batches drawn from torch's generator, as the port's data)
    return {"model": out["model"], "optimizer": out["optimizer"], "loss": out["loss"]}


@needs_xtransformers
@pytest.mark.parametrize("check", checks())
def test_enwik8_loop_as_a_trainer(check):
    """The loop ported (its validation and samples left out): ``grad_accum=2``, ``grad_clip=0.5``; the same model,
    Adam state and last micro-batch losses."""
    ported(enwik8_build, enwik8_hand, Enwik8, check, NUM_BATCHES, grad_accum=GRADIENT_ACCUMULATE_EVERY,
           grad_clip=0.5, guard={"check": check})


def xl_build(seq_len=SEQ_LEN):
    """train_xl_enwik8.py's model at a tiny size: memories of a segment's length, ``shift_mem_down=1``, rotary
    embeddings and ``pre_and_post_norm``, in an ``XLAutoregressiveWrapper(tbptt_steps=2)``, fed sequences of 4
    segments (its ``train_seq_len``: 2048 over segments of 512)."""
    model = XLAutoregressiveWrapper(TransformerWrapper(
        num_tokens=NUM_TOKENS, max_seq_len=seq_len, max_mem_len=seq_len, shift_mem_down=1,
        attn_layers=Decoder(dim=32, depth=2, heads=2, rotary_pos_emb=True, pre_and_post_norm=True)), tbptt_steps=2)
    train_loader = cycle(DataLoader(TextSamplerDataset(enwik8_stream(5), 4 * seq_len), batch_size=BATCH_SIZE,
                                    drop_last=True))
    val_dataset = TextSamplerDataset(enwik8_stream(6), 4 * seq_len)
    val_loader = cycle(DataLoader(val_dataset, batch_size=BATCH_SIZE, drop_last=True))
    return model, Adam(model.parameters(), lr=1e-3), train_loader, val_loader, val_dataset


def xl_loop(model, optim, train_loader, val_loader, val_dataset, guard=None, num_batches=NUM_BATCHES):
    """train_xl_enwik8.py's loop (accelerate's ``backward`` and ``clip_grad_norm_`` on the CPU: the plain calls),
    its sample ``generate(start_tokens, seq_len)`` through the memories at the first iteration."""
    record = {"loss": [], "valid_loss": [], "samples": []}
    for i in range(num_batches):
        with stepped(guard):
            model.train()

            for _ in range(GRADIENT_ACCUMULATE_EVERY):
                loss = model(next(train_loader))
                backward(guard, loss / GRADIENT_ACCUMULATE_EVERY)

            record["loss"].append(loss.item())

            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optim.step()
            optim.zero_grad()

        if i % VALIDATE_EVERY == 0:
            model.eval()
            with torch.no_grad():
                loss = model(next(val_loader))
                record["valid_loss"].append(loss.item())

        if i % GENERATE_EVERY == 0:
            model.eval()
            inp = val_dataset[0][:SEQ_LEN]
            record["samples"].append(model.generate(start_tokens=inp[None, ...], seq_len=GENERATE_LENGTH))
    return {"model": model, "optimizer": optim.state_dict(), **record}


@needs_xtransformers
@pytest.mark.parametrize("check", checks())
def test_xl_enwik8_loop(check):
    """train_xl_enwik8.py: each sequence cut into 4 segments, each segment's memories handed to the next with their
    graph every other segment (``tbptt_steps=2``: one backward through two segments), all inside one step."""
    ref = three_runs(xl_build, xl_loop, check)
    assert len(ref["samples"]) == 2


def xl_build_hand():
    """The README's Transformer-XL (``max_mem_len``, ``shift_mem_down``), Adam, and one long stream cut into
    consecutive segments of 2 sequences."""
    model = TransformerWrapper(num_tokens=NUM_TOKENS, max_seq_len=SEQ_LEN, max_mem_len=SEQ_LEN, shift_mem_down=1,
                               attn_layers=Decoder(dim=32, depth=2, heads=2, rotary_pos_emb=True))
    stream = enwik8_stream(7)[:2 * (4 * SEQ_LEN + 1)].long().view(2, -1)
    return model, Adam(model.parameters(), lr=1e-3), stream


def xl_segments(model, optim, stream, guard=None, mems_kept="library", steps=4):
    """The README's recurrence across training steps: ``logits, mems = model(seg, mems=mems, return_mems=True)``,
    one update per segment. ``mems_kept``: ``library`` (``detach_mems=True``, its default), ``user``
    (``detach_mems=False``, then ``mems = [m.detach() for m in mems]`` after the update), ``graph``
    (``detach_mems=False``: the mistake)."""
    mems = None
    losses = []
    for i in range(steps):
        seg = stream[:, i * SEQ_LEN:(i + 1) * SEQ_LEN + 1]
        with stepped(guard):
            logits, mems = model(seg[:, :-1], mems=mems, return_mems=True, detach_mems=mems_kept == "library")
            loss = F.cross_entropy(logits.transpose(1, 2), seg[:, 1:])
            backward(guard, loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optim.step()
            optim.zero_grad()
        if mems_kept == "user":
            mems = [m.detach() for m in mems]
        losses.append(loss.item())
    return {"model": model, "optimizer": optim.state_dict(), "losses": losses, "mems": mems}


@needs_xtransformers
@pytest.mark.parametrize("mems_kept", ["library", "user"])
@pytest.mark.parametrize("check", checks())
def test_xl_memories_carried_detached(check, mems_kept):
    """Memories detached by x-transformers (``detach_mems=True``) or by the user: quiet, and the same training."""
    ref = three_runs(xl_build_hand, lambda *a, guard=None: xl_segments(*a, guard=guard, mems_kept=mems_kept), check)
    torch.manual_seed(0)
    built = xl_build_hand()
    torch.manual_seed(1)
    same(xl_segments(*built, mems_kept="library"), ref)


def xl_carried(guard=None):
    """``xl_segments`` with the mistake, under watch (``guard`` None) or with ``guard``: the error it raises, after
    which the parameters are as the first update left them."""
    torch.manual_seed(0)
    model, optim, stream = xl_build_hand()
    kept = []
    optim.register_step_post_hook(lambda *_: kept.append({k: v.clone() for k, v in model.state_dict().items()}))
    with pytest.raises(CarriedGraphError) as caught:
        if guard is None:
            with Watch(GraphGuard(check="always"), __file__):
                xl_segments(model, optim, stream, mems_kept="graph")
        else:
            xl_segments(model, optim, stream, guard=guard, mems_kept="graph")
    assert len(kept) == 1
    same(model.state_dict(), kept[0])
    return caught.value


@needs_xtransformers
def test_xl_memories_carried_with_their_graph_are_stopped():
    """``detach_mems=False`` and the memories handed to the next step: bare, its backward fails inside torch
    ("backward through the graph a second time"); with a ``GraphGuard`` and under watch, stopped at step 2 before
    that backward, naming ``mems``, the first update kept and nothing else changed."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        xl_segments(*xl_build_hand(), mems_kept="graph")
    for guard in (GraphGuard(check="always"), None):
        err = xl_carried(guard)
        assert err.step == 2 and re.search(r"held by `local mems\[0\]`", str(err))


@needs_xtransformers
def test_xl_memories_carried_with_their_graph_are_advised_to_detach_the_list():
    """The model returns a new list every step (one tensor per layer, made from the last one): a carried state, as an
    LSTM's ``(h, c)``, not a list piling up a value per step, whose fix (``del mems[:]``) would train with no memory
    at all. The first fix detaches the whole list at the end of each step, as the test above trains it; under watch
    too."""
    for guard in (GraphGuard(check="always"), None):
        err = xl_carried(guard)
        assert "mems = [t.detach() for t in mems]" in err.fixes[0] and "[:]" not in " ".join(err.fixes)
