"""accelerate's own training pieces (``Accelerator.prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``,
``autocast``, ``gather_for_metrics``, ``save_state``/``load_state``, ``unwrap_model``), driven by the loops of
accelerate's examples with tiny stand-in models and data: run bare, under ``safeloop.watch``'s guard (``Watch``, in
process, and one ``python -m safeloop.watch`` subprocess) and with a ``safeloop.GraphGuard`` in the loop, in every guard
mode. Parameters, buffers, optimizer and scheduler state must come out bit for bit the same, with no warning the bare
run does not give. Then the mistakes users of accelerate make, each stopped (or warned about) before its update with
the tensor named, and the fix advised, applied to the same loop, quiet and right (under ``check="always"``: these loops
are shorter than ``auto``'s 10 warm-up steps, which ``auto`` checks as ``always`` does).

Written against accelerate 1.15.0 (its examples at huggingface/accelerate 16cb6eb) and torch 2.13 on CPU.
"""
import contextlib
import math
import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

LIB = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.local_sgd import LocalSGD  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradientAccumulationPlugin, set_seed  # noqa: E402

from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import (CarriedGraphError, DoubleBackwardError, GraphLeakWarning,  # noqa: E402
                             GraphLifecycleError, GraphLifecycleWarning, GraphReuseError, InplaceModificationError,
                             NoGraphError, UnusedGradientWarning)
from safeloop.watch import Watch  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402

HERE = __file__
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fresh():
    """accelerate keeps one ``AcceleratorState`` per process: each run starts from none, as a new script would."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_state(tmp_path, monkeypatch):
    """A fresh ``AcceleratorState``, one thread (tiny models on a shared CPU run faster alone), and a working
    directory of the test's own (where the guard writes its graph pictures)."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fresh()
    yield
    fresh()
    torch.set_num_threads(threads)


# -- what a run leaves: the state compared bit for bit ------------------------------------------------------------
def snapshot(accelerator, models, optimizers=(), schedulers=(), **extra):
    """Every parameter and buffer of the unwrapped models, every tensor of the optimizers' state, the schedulers'
    state, and whatever else the loop recorded (losses, metrics), flattened to one dict."""
    out = {}
    for i, model in enumerate(models):
        for k, v in accelerator.unwrap_model(model).state_dict().items():
            out[f"model{i}.{k}"] = v.detach().clone()
    for i, opt in enumerate(optimizers):
        for p, state in opt.state_dict()["state"].items():
            for k, v in state.items():
                out[f"opt{i}.{p}.{k}"] = v.clone() if torch.is_tensor(v) else v
    for i, sched in enumerate(schedulers):
        out[f"sched{i}"] = repr(sched.state_dict())
    out.update(extra)
    return out


def assert_same(ours, ref):
    assert ours.keys() == ref.keys()
    different = [k for k in ref if not (torch.equal(ours[k], ref[k]) if torch.is_tensor(ref[k]) else ours[k] == ref[k])]
    assert not different, f"differ from the bare run: {different}"


def three_runs(loop, check, guarded=True, **kwargs):
    """``loop(**kwargs)`` bare, under ``Watch`` and (``guarded``) with a ``GraphGuard`` in it, each from a fresh
    ``AcceleratorState`` and the loop's own ``set_seed``; what each leaves compared with the bare run, bit for bit.
    Warnings are errors but those the bare run gives. Returns the bare run's state and its state before training."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        fresh()
        ref = loop(**kwargs)
    with strict(own):
        fresh()
        with Watch(GraphGuard(check=check), HERE):
            watched = loop(**kwargs)
    assert_same(watched, ref)
    if guarded:
        with strict(own):
            fresh()
            ours = loop(guard=GraphGuard(check=check), **kwargs)
        assert_same(ours, ref)
    fresh()
    start = loop(epochs=0, **kwargs)
    moved = [k for k in start if k.startswith("model") and torch.is_tensor(start[k])
             and not torch.equal(start[k], ref[k])]
    assert moved, "nothing trained: the comparison would prove nothing"
    return ref


def hooks(guard, accelerator):
    """(step, backward) of a loop: ``with guard.step():`` and ``guard.check(loss); accelerator.backward(loss)``
    (the pairing docs/guard.md shows for accelerate), or a null context and ``accelerator.backward``."""
    if guard is None:
        return contextlib.nullcontext, accelerator.backward

    def backward(loss, **kwargs):
        guard.check(loss)
        accelerator.backward(loss, **kwargs)
    return guard.step, backward


# -- tiny stand-ins for the examples' models and data -------------------------------------------------------------
def classifier():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class TinySequenceClassifier(nn.Module):
    """Stands in for ``AutoModelForSequenceClassification``: ``model(**batch)`` returns ``.loss`` and ``.logits``."""

    def __init__(self, vocab=13, dim=8, classes=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.norm(self.embed(input_ids).mean(1)))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SimpleNamespace(loss=loss, logits=logits)


class TinyCausalLM(nn.Module):
    """Stands in for ``AutoModelForCausalLM``: ``model(input_ids, labels, num_items_in_batch=n)`` returns the summed
    token loss divided by ``n`` (transformers' loss with ``num_items_in_batch``), or the mean without it."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None, use_cache=False, num_items_in_batch=None):
        logits = self.lm_head(torch.tanh(self.wte(input_ids)))
        logits, labels = logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
        if num_items_in_batch is None:
            loss = F.cross_entropy(logits, labels, ignore_index=-100)
        else:
            loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / num_items_in_batch
        return SimpleNamespace(loss=loss, logits=logits)


def labelled(n=40, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=gen), torch.randint(3, (n,), generator=gen))


def token_dicts(n=24, length=6, vocab=13, seed=5):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (n, length), generator=gen)
    return [{"input_ids": ids[i], "labels": ids[i, 0] % 2} for i in range(n)]


def lm_dicts(n=20, length=7, vocab=11, seed=6):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (n, length), generator=gen)
    labels = ids.clone()
    labels[:, -2:][torch.rand(n, 2, generator=gen) < 0.5] = -100  # padding, so micro-batches count different items
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


# -- examples/cv_example.py: prepare(model, optimizer, dataloaders, scheduler), evaluation between epochs ----------
def cv_loop(guard=None, epochs=2, lr=3e-2, batch_size=8, backward_by_guard=False):
    accelerator = Accelerator(cpu=True)
    set_seed(42)
    step, backward = hooks(guard, accelerator)
    if backward_by_guard:
        backward = guard.backward
    train_dataloader = DataLoader(labelled(), shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(labelled(12, seed=7), shuffle=False, batch_size=5)
    model = classifier()
    # Freezing the base model (all but the classifier, ``model[-1]`` here), as the example does
    for param in model.parameters():
        param.requires_grad = False
    for param in model[-1].parameters():
        param.requires_grad = True
    model = model.to(accelerator.device)
    mean = torch.tensor([0.1, 0.0, -0.1, 0.2]).to(accelerator.device)
    std = torch.tensor([1.0, 0.9, 1.1, 1.2]).to(accelerator.device)
    optimizer = torch.optim.Adam(params=model.parameters(), lr=lr / 25)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer=optimizer, max_lr=lr, epochs=max(epochs, 1),
                                                       steps_per_epoch=len(train_dataloader))
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    metrics = []
    for epoch in range(epochs):
        model.train()
        for batch in train_dataloader:
            with step():
                inputs = (batch[0] - mean) / std
                outputs = model(inputs)
                loss = torch.nn.functional.cross_entropy(outputs, batch[1])
                backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        accurate = 0
        num_elems = 0
        for batch in eval_dataloader:
            inputs = (batch[0] - mean) / std
            with torch.no_grad():
                outputs = model(inputs)
            predictions = outputs.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch[1]))
            accurate_preds = predictions == references
            num_elems += accurate_preds.shape[0]
            accurate += accurate_preds.long().sum()
        metrics.append(accurate.item() / num_elems)
    assert num_elems == 12 if epochs else True  # gather_for_metrics drops nothing on one process
    return snapshot(accelerator, [model], [optimizer], [lr_scheduler], metrics=metrics)


@pytest.mark.parametrize("check", checks())
def test_cv_example_loop(check):
    """examples/cv_example.py: ``Accelerator(cpu=True)``, ``prepare(model, optimizer, train_dataloader,
    eval_dataloader, lr_scheduler)`` with ``OneCycleLR``, the base model frozen but the optimizer given all its
    parameters (``Adam(params=model.parameters())``), ``accelerator.backward``, the prepared optimizer's
    ``step``/``zero_grad``, normalization tensors made before the loop, and an evaluation with
    ``gather_for_metrics`` between epochs (BatchNorm's running statistics compared too)."""
    three_runs(cv_loop, check)


@pytest.mark.parametrize("check", checks())
def test_cv_example_with_guard_backward_in_place_of_accelerator_backward(check):
    """``guard.backward(loss)`` where the example has ``accelerator.backward(loss)``: without accumulation or a loss
    scaler, accelerate's backward is ``(loss / 1).backward()``, so the update is the same, bit for bit."""
    fresh()
    ref = cv_loop()
    fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = cv_loop(guard=GraphGuard(check=check), backward_by_guard=True)
    assert_same(ours, ref)


# -- examples/by_feature/gradient_accumulation.py: accumulate(model), clip_grad_norm_ under sync_gradients ----------
def accumulation_loop(guard=None, epochs=2, gradient_accumulation_steps=2, clip=True, n=40, batch_size=8,
                      backward_by_guard=False, guard_optimizer=False, local_sgd_steps=None, ema=False,
                      evaluate_every=None, sync_with_dataloader=True):
    if sync_with_dataloader:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps)
    else:
        accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=gradient_accumulation_steps, sync_with_dataloader=False))
    set_seed(42)
    train_dataloader = DataLoader(labelled(n), shuffle=True, batch_size=batch_size)
    model = classifier()
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=0.05)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    if ema:
        ema_model = torch.optim.swa_utils.AveragedModel(
            accelerator.unwrap_model(model), multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    eval_dataloader = accelerator.prepare(DataLoader(labelled(10, seed=7), batch_size=4))
    evaluations = []
    if guard is not None and guard_optimizer:
        guard = GraphGuard(model, optimizer, check=guard.guard.check)
    step, backward = hooks(guard, accelerator)
    if backward_by_guard:
        backward = guard.backward
    syncs, lrs, norms = [], [], []
    for epoch in range(epochs):
        model.train()
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps or 1,
                      enabled=local_sgd_steps is not None) as local_sgd:
            for batch in train_dataloader:
                with step():
                    with accelerator.accumulate(model):
                        output = model(batch[0])
                        loss = F.cross_entropy(output, batch[1])
                        if backward_by_guard == "divided":
                            loss = loss / accelerator.gradient_accumulation_steps
                        backward(loss)
                        if clip and accelerator.sync_gradients:
                            norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
                        optimizer.step()
                        lr_scheduler.step()
                        optimizer.zero_grad()
                        local_sgd.step()
                        if ema and accelerator.sync_gradients:
                            ema_model.update_parameters(model)
                    syncs.append(accelerator.sync_gradients)
                    lrs.append(lr_scheduler.get_last_lr()[0])
                if evaluate_every and len(syncs) % evaluate_every == 0:  # inside an accumulation window too
                    model.eval()
                    correct = 0
                    for x, y in eval_dataloader:
                        with torch.no_grad():
                            predictions = (ema_model if ema else model)(x).argmax(dim=-1)
                        predictions, references = accelerator.gather_for_metrics((predictions, y))
                        correct += (predictions == references).sum().item()
                    evaluations.append(correct)
                    model.train()
    if epochs and sync_with_dataloader:  # 5 micro-batches an epoch: updates after the 2nd, 4th and (the end of the
        assert syncs[:5] == [False, True, False, True, True], syncs  # dataloader) 5th
    elif epochs:  # every second micro-batch: the third update spans two epochs
        assert syncs == [False, True] * 5, syncs
    models = [model, ema_model] if ema else [model]
    return snapshot(accelerator, models, [optimizer], [lr_scheduler], syncs=syncs, lrs=lrs, norms=norms,
                    evaluations=evaluations)


@pytest.mark.parametrize("check", checks())
def test_gradient_accumulation_example_with_an_epoch_not_divisible(check):
    """examples/by_feature/gradient_accumulation.py: ``Accelerator(gradient_accumulation_steps=2)``, ``with
    accelerator.accumulate(model):`` around every micro-batch, ``optimizer.step()`` called every iteration and
    skipped by ``AcceleratedOptimizer`` off the sync steps, the ``AcceleratedScheduler`` stepping with it,
    ``accelerator.clip_grad_norm_`` under ``accelerator.sync_gradients``; 5 micro-batches an epoch, so the last
    update of each epoch is of one micro-batch (``GradientState.end_of_dataloader``)."""
    ref = three_runs(accumulation_loop, check)
    assert len(ref["norms"]) == 6 and ref["lrs"][-1] == 0.05 * 0.5 ** 3


@pytest.mark.parametrize("check", checks())
def test_accumulation_with_an_ema_and_evaluations_inside_accumulation_windows(check):
    """The accumulation loop with an EMA of the model (``torch.optim.swa_utils.AveragedModel`` with
    ``get_ema_multi_avg_fn``, updated on ``accelerator.sync_gradients``) and an evaluation of the EMA every 3
    micro-batches (``model.eval()``, ``torch.no_grad()``, ``gather_for_metrics``, ``model.train()``), so some fall
    between the two micro-batches of an update, with gradients accumulated: the EMA's parameters and BatchNorm
    buffers compared too."""
    ref = three_runs(accumulation_loop, check, ema=True, evaluate_every=3)
    assert len(ref["evaluations"]) == 3 and "model1.n_averaged" in ref


@pytest.mark.parametrize("check", checks())
def test_accumulation_window_across_an_epoch_end_and_an_evaluation(check):
    """``GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)``: the end of an epoch no longer forces
    an update, so the fifth micro-batch's gradient waits, through the evaluation of the EMA after the epoch's
    micro-batches, for the first micro-batch of the next epoch."""
    ref = three_runs(accumulation_loop, check, ema=True, evaluate_every=5, sync_with_dataloader=False)
    assert len(ref["norms"]) == 5 and len(ref["evaluations"]) == 2


@pytest.mark.parametrize("check", checks())
def test_local_sgd_example_loop(check):
    """examples/by_feature/local_sgd.py: ``with LocalSGD(accelerator=..., model=..., local_sgd_steps=...)`` around
    the epoch and ``local_sgd.step()`` after each update, inside ``accelerator.accumulate(model)`` (on one process
    LocalSGD averages nothing)."""
    three_runs(accumulation_loop, check, local_sgd_steps=2, clip=False)


@pytest.mark.parametrize("check", checks())
def test_guard_backward_of_the_loss_divided_as_accelerator_backward_divides_it(check):
    """``guard.backward(loss / accelerator.gradient_accumulation_steps)`` in place of ``accelerator.backward(loss)``
    inside ``accelerator.accumulate(model)``: the same division accelerate's backward makes, so the same updates."""
    fresh()
    ref = accumulation_loop()
    fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = accumulation_loop(guard=GraphGuard(check=check), backward_by_guard="divided")
    assert_same(ours, ref)


def test_guard_backward_of_the_undivided_loss_is_not_accelerator_backward():
    """What ``guard.backward`` does not do: accelerate's division by ``gradient_accumulation_steps`` happens inside
    ``accelerator.backward``; ``guard.backward(loss)`` back-propagates the loss as given (twice the gradient at 2
    steps). So the pairing for accelerate is ``guard.check(loss); accelerator.backward(loss)`` (docs/guard.md)."""
    fresh()
    ref = accumulation_loop(clip=False)
    fresh()
    ours = accumulation_loop(guard=GraphGuard(check="always"), clip=False, backward_by_guard="undivided")
    assert ours["model0.0.weight"].shape == ref["model0.0.weight"].shape
    assert not torch.equal(ours["model0.0.weight"], ref["model0.0.weight"])


@pytest.mark.parametrize("check", ["auto"])
def test_guard_given_the_prepared_optimizer(check):
    """``GraphGuard(model, optimizer)`` with the optimizer ``accelerator.prepare`` returned (an
    ``AcceleratedOptimizer``), as docs/guard.md's ``GraphGuard(model, opt)``: a step ends at its real updates, every
    second micro-batch; the run must train as the bare one."""
    fresh()
    ref = accumulation_loop()
    fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = accumulation_loop(guard=GraphGuard(check=check), guard_optimizer=True)
    assert_same(ours, ref)


# -- examples/nlp_example.py and by_feature/checkpointing.py: accumulation by hand, save_state / load_state ---------
def collate_fn(examples):
    return {"input_ids": torch.stack([e["input_ids"] for e in examples]),
            "labels": torch.stack([e["labels"] for e in examples])}


def nlp_loop(guard=None, epochs=2, batch_size=4, gradient_accumulation_steps=2, mixed_precision="no",
             checkpointing_steps=None, output_dir=None, resume_from_checkpoint=None, stop_at=None, shuffle=True):
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    set_seed(42)
    step_, backward = hooks(guard, accelerator)
    train_dataloader = DataLoader(token_dicts(), shuffle=shuffle, collate_fn=collate_fn, batch_size=batch_size,
                                  drop_last=True)
    eval_dataloader = DataLoader(token_dicts(10, seed=8), shuffle=False, collate_fn=collate_fn, batch_size=4)
    model = TinySequenceClassifier()
    model = model.to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=2e-2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 4) * max(0.0, 1 - s / 20))  # a linear warm-up, then decay
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if resume_from_checkpoint:
        accelerator.load_state(resume_from_checkpoint)
        path = os.path.basename(resume_from_checkpoint)
        training_difference = os.path.splitext(path)[0]
        resume_step = int(training_difference.replace("step_", ""))
        starting_epoch = resume_step // len(train_dataloader)
        resume_step -= starting_epoch * len(train_dataloader)
    metrics = []
    for epoch in range(starting_epoch, epochs):
        model.train()
        if resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            with step_():
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / gradient_accumulation_steps
                backward(loss)
                if step % gradient_accumulation_steps == 0:
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            overall_step += 1
            if isinstance(checkpointing_steps, int) and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(output_dir, f"step_{overall_step}"))
            if overall_step == stop_at:
                return None
        model.eval()
        correct = 0
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
        metrics.append(correct)
    accelerator.end_training()
    return snapshot(accelerator, [model], [optimizer], [lr_scheduler], metrics=metrics)


@pytest.mark.parametrize("check", checks())
def test_nlp_example_loop_with_its_accumulation_by_hand(check):
    """examples/nlp_example.py: ``loss = loss / gradient_accumulation_steps``, ``accelerator.backward(loss)`` every
    batch, ``optimizer.step()``/``lr_scheduler.step()``/``zero_grad()`` when ``step % gradient_accumulation_steps ==
    0`` (so after the first batch, then every second: steps of one and of two batches), a batch of dicts, an
    evaluation with ``gather_for_metrics`` after each epoch and ``accelerator.end_training()``."""
    three_runs(nlp_loop, check)


@pytest.mark.parametrize("check", checks())
def test_nlp_example_under_bf16_autocast(check):
    """``Accelerator(cpu=True, mixed_precision="bf16")``: ``prepare`` wraps the model's forward in CPU autocast
    (bfloat16 matmuls), the loss and backward stay as they are (no scaler for bf16)."""
    ref = three_runs(nlp_loop, check, mixed_precision="bf16")
    fresh()
    assert not torch.equal(nlp_loop()["model0.head.weight"], ref["model0.head.weight"]), "bf16 changed nothing"


def test_checkpointing_example_resumed_under_watch_equals_the_uninterrupted_run(tmp_path):
    """examples/by_feature/checkpointing.py: ``accelerator.save_state(f"step_{overall_step}")`` every 4 batches;
    a run stopped after 9 batches, then resumed from ``step_8`` (epoch 1, batch 2) with ``accelerator.load_state``
    and ``accelerator.skip_first_batches``: model, optimizer, scheduler and RNG restored. Run under watch
    (``always``), the interrupted and resumed runs end bit for bit where the bare uninterrupted run ends. (Without
    accumulation and shuffling: the example's resume restarts ``step`` at 0 and a new epoch's permutation, so its
    own bare resume differs from the uninterrupted run there.)"""
    kwargs = dict(gradient_accumulation_steps=1, shuffle=False)
    fresh()
    ref = nlp_loop(checkpointing_steps=4, output_dir=str(tmp_path / "ref"), **kwargs)
    assert sorted(os.listdir(tmp_path / "ref")) == ["step_12", "step_4", "step_8"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh()
        with Watch(GraphGuard(check="always"), HERE):
            assert nlp_loop(checkpointing_steps=4, output_dir=str(tmp_path / "run"), stop_at=9, **kwargs) is None
        fresh()
        with Watch(GraphGuard(check="always"), HERE):
            resumed = nlp_loop(resume_from_checkpoint=str(tmp_path / "run" / "step_8"), **kwargs)
    assert resumed.pop("metrics") == ref.pop("metrics")[1:]  # the evaluation after epoch 1 only
    assert_same(resumed, ref)


# -- a GAN: two models and two optimizers prepared together ------------------------------------------------------
def gan_loop(guard=None, epochs=2, n=32, batch_size=8):
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    real_data = DataLoader(TensorDataset(torch.randn(n, 2) * 0.5 + 1.0), shuffle=True, batch_size=batch_size)
    netG = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    netD = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=1e-2, betas=(0.5, 0.999))
    optimizerD = torch.optim.Adam(netD.parameters(), lr=1e-2, betas=(0.5, 0.999))
    netG, netD, optimizerG, optimizerD, real_data = accelerator.prepare(netG, netD, optimizerG, optimizerD, real_data)
    criterion = nn.BCEWithLogitsLoss()
    for epoch in range(epochs):
        for (real,) in real_data:
            with step():
                noise = torch.randn(real.size(0), 3, device=accelerator.device)
                fake = netG(noise)
                optimizerD.zero_grad()
                errD = criterion(netD(real), torch.ones(real.size(0), 1)) + \
                    criterion(netD(fake.detach()), torch.zeros(real.size(0), 1))
                backward(errD)
                optimizerD.step()
                optimizerG.zero_grad()
                errG = criterion(netD(fake), torch.ones(real.size(0), 1))
                backward(errG)
                optimizerG.step()
    G = accelerator.unwrap_model(netG)
    assert G is netG  # on one process prepare returns the module itself
    return snapshot(accelerator, [netG, netD], [optimizerG, optimizerD])


@pytest.mark.parametrize("check", checks())
def test_gan_with_two_models_and_optimizers_prepared_together(check):
    """``accelerator.prepare(netG, netD, optimizerG, optimizerD, dataloader)``, D's loss on ``fake.detach()``, G's
    through D, ``accelerator.backward`` for each, ``accelerator.unwrap_model``."""
    three_runs(gan_loop, check)


# -- examples/by_feature/gradient_accumulation_for_autoregressive_models.py -----------------------------------------
def lm_collate(examples):
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def autoregressive_loop(guard=None, epochs=2, gradient_accumulation_steps=2, max_grad_norm=1.0, batch_size=4,
                        EVAL_BATCH_SIZE=4):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps)
    set_seed(42)
    step, backward = hooks(guard, accelerator)
    train_dataloader = DataLoader(lm_dicts(), shuffle=True, collate_fn=lm_collate, batch_size=batch_size)
    eval_dataloader = DataLoader(lm_dicts(8, seed=9), shuffle=False, collate_fn=lm_collate, batch_size=EVAL_BATCH_SIZE)
    model = TinyCausalLM()
    model = model.to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=2e-2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # get_constant_schedule
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    num_samples_in_epoch = len(train_dataloader)
    remainder = num_samples_in_epoch % gradient_accumulation_steps
    remainder = remainder if remainder != 0 else gradient_accumulation_steps
    total_gradient_updates = math.ceil(num_samples_in_epoch / gradient_accumulation_steps)
    total_batched_samples = 0
    logged, perplexities = [], []
    for epoch in range(epochs):
        model.train()
        training_iterator = iter(train_dataloader)
        for update_step in range(total_gradient_updates):
            with step():
                batch_samples = []
                num_batches_in_step = (
                    gradient_accumulation_steps if update_step != (total_gradient_updates - 1) else remainder
                )
                for _ in range(num_batches_in_step):
                    batch_samples += [next(training_iterator)]
                local_num_items_in_batch = sum([(batch["labels"].ne(-100)).sum() for batch in batch_samples])
                num_items_in_batch = accelerator.gather(local_num_items_in_batch).sum().item()
                losses = []
                for i, batch in enumerate(batch_samples):
                    ctx = (
                        model.no_sync
                        if (i < len(batch_samples) - 1 and accelerator.num_processes > 1)
                        else contextlib.nullcontext
                    )
                    with ctx():
                        total_batched_samples += 1
                        outputs = model(**batch, use_cache=False, num_items_in_batch=num_items_in_batch)
                        loss = outputs.loss
                        loss = loss * gradient_accumulation_steps * accelerator.num_processes
                        backward(loss)
                        losses.append(loss.detach())
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                losses = accelerator.gather(sum(losses)).sum().item() / (
                    accelerator.num_processes * gradient_accumulation_steps
                )
                grad_norm = grad_norm.detach().item() if isinstance(grad_norm, torch.Tensor) else grad_norm
                logged.append((grad_norm, losses))
        model.eval()
        losses = []
        for step_, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch, use_cache=False)
            eval_loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(EVAL_BATCH_SIZE)))  # sic: `loss`, as the source
        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        perplexities.append(perplexity)
    return snapshot(accelerator, [model], [optimizer], [lr_scheduler], logged=logged, perplexities=perplexities)


@pytest.mark.parametrize("check", checks())
def test_autoregressive_accumulation_example(check):
    """examples/by_feature/gradient_accumulation_for_autoregressive_models.py: the micro-batches of an update
    fetched first, the items counted and ``accelerator.gather``-ed, ``loss * gradient_accumulation_steps *
    num_processes`` back-propagated by ``accelerator.backward`` (which divides it again),
    ``losses.append(loss.detach())``, ``accelerator.clip_grad_norm_`` then the update outside ``accumulate``; 5
    micro-batches an epoch (the last update of one). Its evaluation repeats the last training ``loss`` (a tensor whose
    graph backward freed) as the source does: quiet too."""
    ref = three_runs(autoregressive_loop, check)
    assert len(ref["logged"]) == 6 and all(math.isfinite(norm) for norm, _ in ref["logged"])


# -- the mistakes, as users of accelerate write them ---------------------------------------------------------------
RUN = {}  # the modules of the last mistake run, and their parameters before it


def remember(*models):
    RUN.clear()
    RUN["models"] = models
    RUN["start"] = [p.detach().clone() for m in models for p in m.parameters()]


def untouched():
    """Whether the modules of the last run still have the parameters they started with (no update ran)."""
    return all(torch.equal(p, q) for p, q in zip([p for m in RUN["models"] for p in m.parameters()], RUN["start"],
                                                 strict=True))


class ProtoNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.features(x)


def prototypes_loop(guard=None, epochs=1, fixed=False):
    """Class prototypes projected once, before the loop, and used by every micro-batch (seed 001's ``y = t @ a``)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    dataloader = DataLoader(labelled(24), shuffle=True, batch_size=8)
    model = ProtoNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    remember(model)
    anchors = torch.eye(3, 8)
    prototypes = model.proj(anchors)
    for epoch in range(epochs):
        for x, y in dataloader:
            with step():
                with accelerator.accumulate(model):
                    if fixed:
                        prototypes = model.proj(anchors)
                    logits = model(x) @ prototypes.t()
                    loss = F.cross_entropy(logits, y)
                    backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
    return snapshot(accelerator, [model], [optimizer])


class CharRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x, hidden=None):
        out, hidden = self.rnn(x, hidden)
        return self.head(out[:, -1]), hidden


def rnn_loop(guard=None, epochs=1, fixed=False, guard_steps=True):
    """A stateful RNN over consecutive chunks of one stream (truncated BPTT), its hidden state carried between
    batches; ``shuffle=False`` as the stream's order matters."""
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    gen = torch.Generator().manual_seed(3)
    chunks = TensorDataset(torch.randn(4, 2, 5, 4, generator=gen), torch.randint(3, (4, 2), generator=gen))
    dataloader = DataLoader(chunks, batch_size=None, shuffle=False)
    model = CharRNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    remember(model)
    if not guard_steps:  # docs/guard.md: without `with guard.step()` a new loss checked where the last was starts one
        step = contextlib.nullcontext
    for epoch in range(epochs):
        hidden = None
        for x, y in dataloader:
            with step():
                if fixed and hidden is not None:
                    hidden = hidden.detach()
                logits, hidden = model(x, hidden)
                loss = F.cross_entropy(logits, y)
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return snapshot(accelerator, [model], [optimizer])


def running_loss_loop(guard=None, epochs=2, fixed=False, n=64):
    """examples/complete_nlp_example.py's ``total_loss += loss.detach().float()`` (``with_tracking``), written
    ``total_loss += loss``: every step's graph chained into one tensor for the epoch."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    dataloader = DataLoader(labelled(n), shuffle=True, batch_size=8)
    model = classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    remember(model)
    logged = []
    for epoch in range(epochs):
        model.train()
        total_loss = 0
        for x, y in dataloader:
            with step():
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(x), y)
                    if fixed:
                        total_loss += loss.detach().float()
                    else:
                        total_loss += loss
                    backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
        logged.append(total_loss.item() / len(dataloader))
    return snapshot(accelerator, [model], [optimizer], logged=logged)


def no_graph_loop(guard=None, epochs=1, fixed=False):
    """A training step whose forward was copied from the evaluation loop, ``torch.no_grad()`` and all."""
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    dataloader = DataLoader(labelled(16), shuffle=True, batch_size=8)
    model = classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    remember(model)
    for epoch in range(epochs):
        model.train()
        for x, y in dataloader:
            with step():
                if fixed:
                    outputs = model(x)
                else:
                    with torch.no_grad():
                        outputs = model(x)
                loss = F.cross_entropy(outputs, y)
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return snapshot(accelerator, [model], [optimizer])


def inplace_loop(guard=None, epochs=1, fixed=False):
    """Features normalized in place (``features /= features.norm(...)``): ``tanh`` saved its output for backward."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    dataloader = DataLoader(labelled(24), shuffle=True, batch_size=8)
    model = ProtoNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    remember(model)
    for epoch in range(epochs):
        for x, y in dataloader:
            with step():
                with accelerator.accumulate(model):
                    features = model(x)
                    if fixed:
                        features = features / features.norm(dim=1, keepdim=True)
                    else:
                        features /= features.norm(dim=1, keepdim=True)
                    loss = F.cross_entropy(model.proj(features)[:, :3], y)
                    backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
    return snapshot(accelerator, [model], [optimizer])


def double_backward_loop(guard=None, epochs=1, fixed=False):
    """A loop ported to accelerate with its old ``loss.backward()`` left above the new ``accelerator.backward(loss)``
    (seed 002's backward twice)."""
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    dataloader = DataLoader(labelled(16), shuffle=True, batch_size=8)
    model = classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    remember(model)
    for epoch in range(epochs):
        for x, y in dataloader:
            with step():
                loss = F.cross_entropy(model(x), y)
                if not fixed:
                    loss.backward()
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return snapshot(accelerator, [model], [optimizer])


def gan_mistake_loop(guard=None, epochs=1, mistake="fake", fixed=False):
    """The GAN above with D's loss on ``netD(fake)`` (``fake.detach()`` forgotten), or with G's loss computed before
    D's update and back-propagated after it (seed 004's optimizer step between a loss and its backward)."""
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    real_data = DataLoader(TensorDataset(torch.randn(24, 2) * 0.5 + 1.0), shuffle=True, batch_size=8)
    netG = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    netD = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=1e-2, betas=(0.5, 0.999))
    optimizerD = torch.optim.Adam(netD.parameters(), lr=1e-2, betas=(0.5, 0.999))
    netG, netD, optimizerG, optimizerD, real_data = accelerator.prepare(netG, netD, optimizerG, optimizerD, real_data)
    remember(netG, netD)
    criterion = nn.BCEWithLogitsLoss()
    for epoch in range(epochs):
        for (real,) in real_data:
            with step():
                noise = torch.randn(real.size(0), 3)
                fake = netG(noise)
                ones, zeros = torch.ones(real.size(0), 1), torch.zeros(real.size(0), 1)
                if mistake == "update":
                    if not fixed:
                        errG = criterion(netD(fake), ones)
                    optimizerD.zero_grad()
                    errD = criterion(netD(real), ones) + criterion(netD(fake.detach()), zeros)
                    backward(errD)
                    optimizerD.step()
                    if fixed:
                        errG = criterion(netD(fake), ones)
                else:
                    optimizerD.zero_grad()
                    errD = criterion(netD(real), ones) + criterion(netD(fake if not fixed else fake.detach()), zeros)
                    backward(errD)
                    optimizerD.step()
                    errG = criterion(netD(fake), ones)
                optimizerG.zero_grad()
                backward(errG)
                optimizerG.step()
    return snapshot(accelerator, [netG, netD], [optimizerG, optimizerD])


WATCHED = {}


def under_watch(loop, check="auto", **kwargs):
    """``loop(**kwargs)`` under ``Watch``, run once for given arguments (a watched run costs seconds) and replayed
    after: the same error raised, the same warnings given, the same modules in ``RUN``."""
    key = (loop.__name__, check, tuple(sorted(kwargs.items())))
    if key not in WATCHED:
        fresh()
        error = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with Watch(GraphGuard(check=check), HERE):
                    loop(**kwargs)
            except Exception as e:
                error = e
        WATCHED[key] = (error, [w.message for w in caught], dict(RUN))
    error, given, run = WATCHED[key]
    RUN.clear()
    RUN.update(run)
    for message in given:
        warnings.warn(message)
    if error is not None:
        raise error


def with_guard(loop, check="auto", **kwargs):
    return loop(guard=GraphGuard(check=check), **kwargs)


WATCH_NAMES_NOTHING = ("under watch a backward run by accelerator.backward (its frame in accelerate/accelerator.py) is "
                       "checked with accelerate's frame: nothing of the loop is named, ")


# seed 001: a tensor built outside the step and reused by every step
def test_prototypes_built_before_the_loop_are_named_under_watch():
    """``prototypes = model.proj(anchors)`` after ``accelerator.prepare`` and before the loop, used by every
    micro-batch inside ``accelerator.accumulate``: under watch, stopped before a backward through it with
    ``prototypes`` named and the advice to make it inside the loop (as ``GraphGuard`` says at step 1)."""
    with pytest.raises((GraphReuseError, CarriedGraphError, DoubleBackwardError)) as info:
        under_watch(prototypes_loop)
    assert re.search(r"held by `local prototypes`.*(recompute|make) `prototypes`", str(info.value)), str(info.value)


def test_prototypes_built_before_the_loop_are_named_by_graph_guard():
    """The same loop with ``with guard.step():`` and ``guard.check(loss); accelerator.backward(loss)``: a
    ``GraphReuseError`` at step 1, before its backward (no parameter moved), naming ``prototypes`` and saying to
    recompute it inside the loop."""
    with pytest.raises(GraphReuseError, match=r"\(step 1, .*held by `local prototypes`.*To fix: recompute "
                                              r"`prototypes` inside the loop") as info:
        with_guard(prototypes_loop)
    assert info.value.holder == "local prototypes"
    assert untouched()


@pytest.mark.parametrize("check", ["always"])
def test_prototypes_recomputed_inside_the_loop_run_quiet_and_right(check):
    """The advised fix, ``prototypes = model.proj(anchors)`` inside ``accelerator.accumulate``: quiet and the same
    as bare in every mode."""
    three_runs(prototypes_loop, check, fixed=True)


# an RNN's hidden state carried with its graph
def test_rnn_hidden_state_carried_is_named_under_watch():
    """``logits, hidden = model(x, hidden)`` over consecutive chunks with ``accelerator.backward(loss)``: under
    watch, a ``CarriedGraphError`` naming ``hidden`` and advising ``hidden = hidden.detach()``."""
    with pytest.raises(GraphLifecycleError) as info:
        under_watch(rnn_loop)
    assert isinstance(info.value, CarriedGraphError), str(info.value)
    assert "`hidden = hidden.detach()`" in str(info.value)


def test_rnn_hidden_state_carried_is_named_by_graph_guard():
    """With ``GraphGuard``: a ``CarriedGraphError`` at step 2, before its backward, naming ``hidden`` and the fix."""
    with pytest.raises(CarriedGraphError, match=r"\(step 2, .*held by `local hidden`.*`hidden = hidden.detach\(\)`"):
        with_guard(rnn_loop)


def test_rnn_hidden_state_carried_without_guard_steps_is_named_by_graph_guard():
    """``GraphGuard(model)`` with ``guard.check(loss); accelerator.backward(loss)`` and no ``with guard.step():``
    (``GraphGuard(model, optimizer)`` cannot take accelerate's optimizer): the loop comes round at the same
    ``guard.check``, so the second iteration is a second step and the carried ``hidden`` a ``CarriedGraphError``."""
    with pytest.raises(GraphLifecycleError) as info:
        with_guard(rnn_loop, guard_steps=False)
    assert isinstance(info.value, CarriedGraphError), str(info.value)
    assert "`hidden = hidden.detach()`" in str(info.value)


@pytest.mark.parametrize("check", ["always"])
def test_rnn_hidden_state_detached_runs_quiet_and_right(check):
    """The advised ``hidden = hidden.detach()`` at the start of each step: quiet and the same as bare."""
    three_runs(rnn_loop, check, fixed=True)


# a running loss kept with its graph
def leak_messages(how, check="auto"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (under_watch if how == "watch" else with_guard)(running_loss_loop, check=check)
    return [str(w.message) for w in caught if issubclass(w.category, GraphLeakWarning)]


def test_running_total_loss_with_its_graph_is_named_under_watch():
    """``total_loss += loss`` (complete_nlp_example's ``total_loss += loss.detach().float()`` without the detach),
    inside ``accelerator.accumulate``: under watch, a ``GraphLeakWarning`` that graphs of two steps are alive,
    naming ``total_loss``, with the fix ``loss.item()`` or ``loss.detach()``."""
    leaks = leak_messages("watch")
    assert leaks, "no GraphLeakWarning"
    assert any("`local total_loss`" in text for text in leaks), leaks
    assert any("graphs of both steps are still alive" in t and "loss.detach()" in t for t in leaks), leaks


def test_running_total_loss_with_its_graph_is_named_by_graph_guard():
    """With ``GraphGuard`` (a step per micro-batch): a ``GraphLeakWarning`` naming ``total_loss``."""
    leaks = leak_messages("guard")
    assert any("held by `local total_loss`" in t and "loss.detach()" in t for t in leaks), leaks


@pytest.mark.parametrize("check", ["always"])
def test_running_total_loss_detached_runs_quiet_and_right(check):
    """The example's own ``total_loss += loss.detach().float()``: quiet, and the same logged losses as bare."""
    three_runs(running_loss_loop, check, fixed=True)


# a loss without a graph
@pytest.mark.parametrize("how", ["watch", "guard"])
def test_loss_computed_under_no_grad_is_stopped_before_backward(how):
    """A training forward under ``torch.no_grad()``: accelerate divides the loss (``loss / 1``) and calls
    ``loss.backward()``; stopped before it as a ``NoGraphError`` that says the loss was computed without grad."""
    with pytest.raises(NoGraphError, match=r"loss has no autograd graph \(step 1.*computed under no_grad.*To fix: "
                                           r"make sure the loss is computed from the model's output inside the loop"):
        (under_watch if how == "watch" else with_guard)(no_graph_loop)
    assert untouched()


@pytest.mark.parametrize("check", ["always"])
def test_loss_computed_with_grad_runs_quiet_and_right(check):
    """The fix: the training forward outside ``torch.no_grad()``."""
    three_runs(no_graph_loop, check, fixed=True)


# backward twice through one graph
def test_loss_backward_left_above_accelerator_backward_advises_deleting_one_under_watch():
    """``loss.backward()`` left above ``accelerator.backward(loss)``: under watch, a ``DoubleBackwardError`` before
    the second, naming ``loss``, whose first fix is to delete one backward (not ``retain_graph=True``)."""
    with pytest.raises(DoubleBackwardError, match=r"made from `loss`") as info:
        under_watch(double_backward_loop)
    assert untouched()
    assert "(step 1, " in str(info.value), str(info.value)
    fixes = str(info.value).split("To fix:")[1]
    assert re.match(r"\s*(call backward once|delete the second backward|back-propagate it once: delete)", fixes), \
        fixes


def test_loss_backward_left_above_accelerator_backward_is_stopped_by_graph_guard():
    """With ``GraphGuard``: ``guard.check(loss)`` before ``accelerator.backward(loss)`` finds the graph already
    back-propagated and says to call backward once per loss."""
    with pytest.raises(DoubleBackwardError, match=r"\(step 1, .*already back-propagated.*To fix: call backward once"):
        with_guard(double_backward_loop)


@pytest.mark.parametrize("check", ["always"])
def test_one_accelerator_backward_runs_quiet_and_right(check):
    """The fix: ``accelerator.backward(loss)`` alone."""
    three_runs(double_backward_loop, check, fixed=True)


# an in-place change to a tensor autograd saved
def test_features_normalized_in_place_are_named_under_watch():
    """``features /= features.norm(dim=1, keepdim=True)`` on ``tanh``'s output, which ``tanh`` saved: under watch,
    an ``InplaceModificationError`` at step 1, no parameter moved, naming ``features`` and the out-of-place form."""
    with pytest.raises(InplaceModificationError, match=r"modified in place \(step 1, .*To fix: use the out-of-place "
                                                       r"form") as info:
        under_watch(inplace_loop)
    assert "`local features`" in str(info.value), str(info.value)
    assert untouched()


def test_features_normalized_in_place_are_explained_by_graph_guard():
    """With ``GraphGuard``: an ``InplaceModificationError`` naming ``features`` (``guard.backward`` gives one)."""
    with pytest.raises(InplaceModificationError, match=r"`local features`"):
        with_guard(inplace_loop)


@pytest.mark.parametrize("check", ["always"])
def test_features_normalized_out_of_place_run_quiet_and_right(check):
    """The advised out-of-place form ``features = features / features.norm(...)``: quiet, the same as bare."""
    three_runs(inplace_loop, check, fixed=True)


# a GAN: D's loss through the generator's graph; G's loss built before D's update
def test_gan_fake_not_detached_is_named_under_watch():
    """D's loss on ``netD(fake)`` where ``fake.detach()`` is meant, with ``accelerator.backward``: under watch, a
    ``DoubleBackwardError`` before G's backward naming ``fake`` with the fix ``fake.detach()`` (as watch says for a
    loop calling ``loss.backward()``)."""
    with pytest.raises(DoubleBackwardError) as info:
        under_watch(gan_mistake_loop)
    assert "`local fake`" in str(info.value) and "fake.detach()" in str(info.value), str(info.value)


def test_gan_fake_not_detached_is_named_by_graph_guard():
    """With ``GraphGuard``: a ``DoubleBackwardError`` at step 1, before G's backward, naming ``fake``."""
    with pytest.raises(DoubleBackwardError, match=r"\(step 1, .*held by `local fake`"):
        with_guard(gan_mistake_loop)


def test_gan_generator_loss_before_the_discriminator_update_is_explained_under_watch():
    """G's loss through ``netD`` built before ``optimizerD.step()`` and back-propagated after it (seed 004):
    under watch an ``InplaceModificationError`` naming the update between them, and the fix: the generator loss
    from a fresh ``D(fake)`` after the discriminator step."""
    with pytest.raises(InplaceModificationError, match=r"optimizer '[^']+' stepped after this loss was built and "
                                                       r"before its backward.*the generator loss from a fresh "
                                                       r"D\(fake\) after the discriminator step"):
        under_watch(gan_mistake_loop, mistake="update")


def test_gan_generator_loss_before_the_discriminator_update_names_the_update_and_the_loss_under_watch():
    """Under watch the error names ``optimizerD``, the loop's variable for the update in between, and ``errG``."""
    with pytest.raises(InplaceModificationError) as info:
        under_watch(gan_mistake_loop, mistake="update")
    assert "optimizerD" in str(info.value) and "errG" in str(info.value), str(info.value)


def test_gan_generator_loss_before_the_discriminator_update_is_explained_by_graph_guard():
    """With ``GraphGuard``: an ``InplaceModificationError`` naming ``errG``, before its backward."""
    with pytest.raises(InplaceModificationError, match=r"`local errG`"):
        with_guard(gan_mistake_loop, mistake="update")


@pytest.mark.parametrize("mistake", ["fake", "update"])
@pytest.mark.parametrize("check", ["always"])
def test_gan_fixed_runs_quiet_and_right(check, mistake):
    """The fixes: ``netD(fake.detach())`` in D's loss; G's loss from a fresh ``netD(fake)`` after D's update."""
    three_runs(gan_mistake_loop, check, mistake=mistake, fixed=True)


# -- python -m safeloop.watch on an unmodified accelerate script ---------------------------------------------------
SCRIPT = '''
import hashlib
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, set_seed
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)


def main():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    gen = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(40, 4, generator=gen), torch.randint(3, (40,), generator=gen))
    dataloader = DataLoader(data, shuffle=True, batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    BEFORE
    for epoch in range(2):
        model.train()
        for x, y in dataloader:
            with accelerator.accumulate(model):
                loss = LOSS
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    state = accelerator.unwrap_model(model).state_dict()
    digest = hashlib.sha256()
    for k in sorted(state):
        digest.update(state[k].numpy().tobytes())
    for s in optimizer.state_dict()["state"].values():
        digest.update(s["exp_avg_sq"].numpy().tobytes())
    print("checksum", digest.hexdigest(), scheduler.get_last_lr())


main()
'''


PRIOR = {"before": "prior = model(torch.ones(2, 4)).softmax(-1)",
         "loss": "F.cross_entropy(model(x), y) + prior.mean()"}


def start_script(directory, *args, before="", loss="F.cross_entropy(model(x), y)"):
    directory.mkdir()
    script = directory / "train_accelerate.py"
    script.write_text(SCRIPT.replace("BEFORE", before).replace("LOSS", loss))
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, *args, str(script)], cwd=directory, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """The script bare and under ``python -m safeloop.watch --check always``, and with the prior under
    ``python -m safeloop.watch`` and bare, run side by side: {name: (returncode, stdout, stderr)}."""
    root = tmp_path_factory.mktemp("scripts")
    watch = ("-m", "safeloop.watch")
    procs = {"bare": start_script(root / "bare"),
             "watched": start_script(root / "watched", *watch, "--check", "always"),
             "prior": start_script(root / "prior", **PRIOR),
             "prior watched": start_script(root / "pw", *watch, **PRIOR)}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (proc.returncode, out, err)
    return results


def test_watch_subprocess_on_an_accelerate_script_prints_the_bare_checksum(scripts):
    """``python -m safeloop.watch train_accelerate.py``: ``prepare`` of a model, AdamW, a shuffled dataloader and a
    scheduler, ``accumulate`` over 5 micro-batches an epoch, ``accelerator.backward``, ``clip_grad_norm_`` on sync
    steps. The watched script prints the checksum of its parameters, buffers and Adam state the bare script
    prints, and nothing on stderr the bare script does not."""
    (code, out, err), (wcode, wout, werr) = scripts["bare"], scripts["watched"]
    assert code == 0, err
    assert wcode == 0, werr
    assert out.startswith("checksum ") and wout == out
    assert werr == err


def test_watch_subprocess_stops_a_statistic_built_before_the_loop(scripts):
    """The same script with a prior made from the model before the loop and added to each loss
    (``prior = model(...).softmax(-1)``, ``loss = ... + prior.mean()``): the bare script dies of PyTorch's 'backward
    through the graph a second time'; ``python -m safeloop.watch`` exits with the guard's error instead, raised
    before that backward."""
    code, out, err = scripts["prior"]
    assert code != 0 and "backward through the graph a second time" in err, err
    code, out, err = scripts["prior watched"]
    assert code != 0
    assert re.search(r"safeloop\.errors\.\w+Error: .*\(step \d+, loss 'loss'\)", err), err
    assert "Trying to backward through the graph a second time" not in err.split("safeloop.errors.")[0]


def test_watch_subprocess_names_the_statistic_built_before_the_loop(scripts):
    """The guard's error under ``python -m safeloop.watch`` names ``prior`` and says to recompute it in the loop."""
    code, out, err = scripts["prior watched"]
    assert re.search(r"held by `local prior`.*(recompute|make) `prior`", err), err


# accelerate's docstring example: `with accelerator.autocast(): train()`, one autocast region around the whole loop
def autocast_loop(guard=None, epochs=2, fixed=False):
    """``Accelerator(mixed_precision="bf16")`` and ``with accelerator.autocast():`` (``Accelerator.autocast``'s
    docstring: ``with accelerator.autocast(): train()``) around the whole loop, or (``fixed``) around each step's
    forward and loss. Autocast caches its bfloat16 casts of the weights until the outermost region exits: inside
    one region the optimizer's updates never reach the forward."""
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    dataloader = DataLoader(labelled(24), shuffle=False, batch_size=8)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    remember(model)
    losses = []

    def train():
        for epoch in range(epochs):
            for x, y in dataloader:
                with step():
                    with accelerator.autocast() if fixed else contextlib.nullcontext():
                        loss = F.cross_entropy(model(x), y)
                    backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    losses.append(loss.item())
    if fixed:
        train()
    else:
        with accelerator.autocast():
            train()
    return snapshot(accelerator, [model], [optimizer], losses=losses)


def test_one_autocast_region_around_the_loop_freezes_the_forward_weights():
    """What the mistake does, bare: the second epoch replays the first epoch's losses exactly, though SGD moved
    every weight; the fixed loop's second epoch differs."""
    fresh()
    losses = autocast_loop(epochs=2)["losses"]
    assert losses[:3] == losses[3:]
    fresh()
    losses = autocast_loop(epochs=2, fixed=True)["losses"]
    assert losses[:3] != losses[3:]


def autocast_said(how):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            (under_watch if how == "watch" else with_guard)(autocast_loop)
        except GraphLifecycleError as e:
            return e
    return [str(w.message) for w in caught if issubclass(w.category, GraphLifecycleWarning)]


def test_one_autocast_region_around_the_loop_is_reported_under_watch():
    """Under watch, the casts kept by the autocast region are reported before the second step's backward (its
    forward already used stale weights), with a fix naming autocast, as ``GraphGuard`` does."""
    said = autocast_said("watch")
    assert isinstance(said, CarriedGraphError) and "(step 2," in str(said), said


def test_one_autocast_region_around_the_loop_is_reported_by_graph_guard():
    """With ``GraphGuard``: a ``CarriedGraphError`` naming autocast's low-precision copy of a weight, with the fix:
    autocast around each iteration's forward and loss, or ``torch.clear_autocast_cache()`` after each update."""
    said = autocast_said("guard")
    assert isinstance(said, CarriedGraphError), said
    assert re.search(r"ToCopyBackward0, a low-precision copy of a weight that torch.autocast made during an earlier "
                     r"step.*To fix: enter torch.autocast around each forward and its loss only.*"
                     r"torch.clear_autocast_cache\(\)", str(said))


def test_one_autocast_region_around_the_loop_is_stopped_before_the_first_stale_update():
    """The first forward with stale weights is step 2's: stopped before its backward, with a message in good form."""
    said = autocast_said("guard")
    assert "(step 2," in str(said) and " or or " not in str(said), str(said)


@pytest.mark.parametrize("check", checks())
def test_autocast_region_around_each_forward_runs_quiet_and_right(check):
    """The fix: ``with accelerator.autocast():`` around each step's forward and loss (bfloat16 on CPU)."""
    three_runs(autocast_loop, check, fixed=True)


# -- two losses through one trunk, each back-propagated by accelerator.backward ----------------------------------
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.cls = nn.Linear(8, 3)
        self.reg = nn.Linear(8, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.reg(h).squeeze(-1)


def two_heads_loop(guard=None, epochs=2, train_batch_size=8, gradient_accumulation_steps=2, retain=True):
    """Two losses through a shared trunk inside ``accelerator.accumulate``: ``accelerator.backward(loss_cls,
    retain_graph=True)`` then ``accelerator.backward(loss_reg)``; the logged loss as diffusers' training scripts
    log it, ``accelerator.gather(loss.repeat(train_batch_size)).mean()`` and ``train_loss += avg_loss.item() /
    gradient_accumulation_steps``, reset after each update."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    dataloader = DataLoader(labelled(40), shuffle=True, batch_size=train_batch_size)
    model = TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    remember(model)
    logged = []
    train_loss = 0.0
    for epoch in range(epochs):
        for x, y in dataloader:
            with step():
                with accelerator.accumulate(model):
                    logits, value = model(x)
                    loss_cls = F.cross_entropy(logits, y)
                    loss_reg = F.mse_loss(value, x.sum(-1))
                    loss = loss_cls + loss_reg
                    avg_loss = accelerator.gather(loss.repeat(train_batch_size)).mean()
                    train_loss += avg_loss.item() / gradient_accumulation_steps
                    backward(loss_cls, retain_graph=retain)
                    backward(loss_reg)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_value_(model.parameters(), 0.5)
                    optimizer.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    logged.append(train_loss)
                    train_loss = 0.0
    return snapshot(accelerator, [model], [optimizer], logged=logged)


@pytest.mark.parametrize("check", checks())
def test_two_losses_through_one_trunk_each_by_accelerator_backward(check):
    """``accelerator.backward(loss, retain_graph=True)`` (its ``**kwargs`` passed to ``loss.backward``) for the first
    of two losses sharing a trunk, inside ``accelerator.accumulate``; ``accelerator.gather`` of the repeated loss
    for logging; ``accelerator.clip_grad_value_`` on sync steps. (``retain=False``, the mistake: without it.)"""
    ref = three_runs(two_heads_loop, check)
    assert len(ref["logged"]) == 6


def test_two_losses_through_one_trunk_without_retain_graph_under_watch():
    """``accelerator.backward(loss_cls)`` without ``retain_graph=True``, then ``accelerator.backward(loss_reg)``
    through the same trunk: under watch, a ``DoubleBackwardError`` at step 1, before the second backward, whose
    first fix is ``retain_graph=True`` on the first."""
    with pytest.raises(DoubleBackwardError) as info:
        under_watch(two_heads_loop, retain=False)
    assert "(step 1," in str(info.value), str(info.value)
    assert re.match(r"\s*pass retain_graph=True", str(info.value).split("To fix:")[1]), str(info.value)


def test_two_losses_through_one_trunk_without_retain_graph_by_graph_guard():
    """With ``GraphGuard``: a ``DoubleBackwardError`` at step 1, no parameter moved, saying both losses share the
    graph and to pass ``retain_graph=True`` to the first backward."""
    with pytest.raises(DoubleBackwardError, match=r"\(step 1, .*both losses share that graph\. To fix: pass "
                                                  r"retain_graph=True to the backward"):
        with_guard(two_heads_loop, retain=False)
    assert untouched()


# -- examples/by_feature/memory.py: find_executable_batch_size retrying the training at a smaller batch ------------
def memory_loop(guard=None, epochs=2, starting_batch_size=9):
    """The example's ``inner_training_loop`` under ``@find_executable_batch_size``; an out-of-memory error (raised
    by hand, as CUDA words it) comes at the third step of the batch size 9, after two updates and a forward:
    the decorator lowers the batch size to 8 and runs the whole function again, on a new model."""
    from accelerate.utils import find_executable_batch_size
    accelerator = Accelerator(cpu=True)
    attempts = []

    @find_executable_batch_size(starting_batch_size=starting_batch_size)
    def inner_training_loop(batch_size):
        accelerator.free_memory()  # Free all lingering references
        attempts.append(batch_size)
        step, backward = hooks(guard, accelerator)
        set_seed(42)
        model = classifier()
        model = model.to(accelerator.device)
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=1e-2)
        train_dataloader = DataLoader(labelled(48), shuffle=True, batch_size=batch_size)
        lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=12)
        model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, lr_scheduler
        )
        for epoch in range(epochs):
            model.train()
            for i, batch in enumerate(train_dataloader):
                with step():
                    outputs = model(batch[0])
                    loss = F.cross_entropy(outputs, batch[1])
                    if batch_size > 8 and i == 2:
                        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
                    backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
        return model, optimizer, lr_scheduler

    model, optimizer, lr_scheduler = inner_training_loop()
    assert attempts == ([9, 8] if epochs else [9])  # accelerate 1.15 takes 90% of it each time
    return snapshot(accelerator, [model], [optimizer], [lr_scheduler], attempts=attempts)


@pytest.mark.parametrize("check", checks())
def test_memory_example_retried_at_a_smaller_batch_size(check):
    """``accelerate.utils.find_executable_batch_size`` around the training function, ``accelerator.free_memory()``,
    everything built and prepared again at a lower batch size after each out-of-memory error, which leaves that
    attempt's forward unused: the last attempt trains as the bare one."""
    three_runs(memory_loop, check)


# -- layers in a plain list: gradients no optimizer uses -----------------------------------------------------------
class ListedBlocks(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]
        self.blocks = nn.ModuleList(blocks) if fixed else blocks  # a plain list: not registered, not optimized
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def listed_loop(guard=None, epochs=1, fixed=False):
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    dataloader = DataLoader(labelled(48), shuffle=True, batch_size=8)
    model = ListedBlocks(fixed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    for epoch in range(epochs):
        for x, y in dataloader:
            with step():
                loss = F.cross_entropy(model(x), y)
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return snapshot(accelerator, [model], [optimizer])


def test_layers_in_a_plain_list_are_named_under_watch():
    """``self.blocks = [nn.Linear(...), ...]``: their parameters are not the module's, so not the optimizer's; under
    watch (which warns so in a plain loop), an ``UnusedGradientWarning`` naming ``model.blocks[0].weight``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        under_watch(listed_loop, check="always")
    said = [str(w.message) for w in caught if issubclass(w.category, UnusedGradientWarning)]
    assert any("`model.blocks[0].weight`" in text for text in said), said


@pytest.mark.parametrize("check", ["always"])
def test_layers_in_a_module_list_run_quiet_and_right(check):
    """The fix ``nn.ModuleList``: quiet, the same as bare."""
    three_runs(listed_loop, check, fixed=True)


# -- WGAN-GP with critic iterations, every backward by accelerator.backward ----------------------------------------
def wgan_gp_loop(guard=None, epochs=1, n_critic=2, lambda_gp=10.0):
    """A WGAN-GP as accelerate users port it: ``n_critic`` critic updates per generator update, each drawing its own
    real batch; the gradient penalty by ``torch.autograd.grad(..., create_graph=True)``; both updates'
    ``accelerator.backward``; the generator's loss through the ``fake`` of a fresh generator forward."""
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    step, backward = hooks(guard, accelerator)
    real_data = DataLoader(TensorDataset(torch.randn(48, 2) * 0.5 + 1.0), shuffle=True, batch_size=8, drop_last=True)
    netG = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    netD = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=1e-3, betas=(0.5, 0.9))
    optimizerD = torch.optim.Adam(netD.parameters(), lr=1e-3, betas=(0.5, 0.9))
    netG, netD, optimizerG, optimizerD, real_data = accelerator.prepare(netG, netD, optimizerG, optimizerD, real_data)

    def gradient_penalty(real, fake):
        alpha = torch.rand(real.size(0), 1)
        interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        d_interpolates = netD(interpolates)
        gradients = torch.autograd.grad(outputs=d_interpolates, inputs=interpolates,
                                        grad_outputs=torch.ones_like(d_interpolates), create_graph=True,
                                        retain_graph=True)[0]
        return ((gradients.norm(2, dim=1) - 1) ** 2).mean()

    for epoch in range(epochs):
        data_iter = iter(real_data)
        for i in range(len(real_data) // n_critic):
            with step():
                for _ in range(n_critic):
                    (real,) = next(data_iter)
                    optimizerD.zero_grad()
                    fake = netG(torch.randn(real.size(0), 3)).detach()
                    d_loss = netD(fake).mean() - netD(real).mean() + lambda_gp * gradient_penalty(real, fake)
                    backward(d_loss)
                    optimizerD.step()
                optimizerG.zero_grad()
                fake = netG(torch.randn(8, 3))
                g_loss = -netD(fake).mean()
                backward(g_loss)
                optimizerG.step()
    return snapshot(accelerator, [netG, netD], [optimizerG, optimizerD])


@pytest.mark.parametrize("check", checks())
def test_wgan_gp_with_critic_iterations(check):
    """Two models and optimizers prepared together, ``n_critic=2`` critic updates per generator update, a gradient
    penalty through ``torch.autograd.grad(create_graph=True)``, every backward by ``accelerator.backward``."""
    three_runs(wgan_gp_loop, check)
