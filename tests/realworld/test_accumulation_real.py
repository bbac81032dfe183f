"""Gradient accumulation, learning-rate schedules, clipping and what gets logged, as public training loops write
them, each against its hand-written loop (``compare``: every parameter bit for bit) and, where the loop logs, the
numbers it logs against what the port's loggers get.

- Accelerate's accumulation for autoregressive models: huggingface/accelerate,
  examples/by_feature/gradient_accumulation_for_autoregressive_models.py (each update's micro-batches read ahead to
  count ``num_items_in_batch``, the label tokens that are not -100, over the group, the pass's last group the
  batches left; each loss summed over its tokens and divided by that count, as transformers'
  src/transformers/loss/loss_utils.py ``ForCausalLMLoss`` / ``fixed_cross_entropy`` do, then multiplied by
  ``gradient_accumulation_steps`` because ``accelerator.backward`` divides by it; ``accelerator.clip_grad_norm_``
  at 1.0, AdamW, ``get_constant_schedule`` stepped after each update; logged per update: the grad norm
  ``clip_grad_norm_`` returns and ``sum(losses) / gradient_accumulation_steps``). One process, no mixed precision,
  so ``accelerator.backward(loss)`` is ``(loss / gradient_accumulation_steps).backward()`` and ``gather`` returns
  its tensor. The evaluation (which reads the training ``loss``) and tracking set-up are left out. The port counts
  the items the same way in a wrapper over the batches, returns the loss times ``grad_accum`` as the loop does (the
  Trainer divides by it), and logs the norm from ``on_before_optimizer_step``.
- timm's per-update schedule and its log line: huggingface/pytorch-image-models, train.py (``train_one_epoch``:
  ``lrl = [param_group['lr'] for ...]`` logged at ``update_idx % args.log_interval == 0``, *before*
  ``lr_scheduler.step_update(num_updates=num_updates, ...)``). The port is test_schedulers_real's ``TimmLoop``
  (``step_update`` in ``on_step_end``, as the Trainer's own error message for timm's schedulers says to).
- Accelerate's tracking example: huggingface/accelerate, examples/by_feature/tracking.py (per epoch: the summed
  training loss ``total_loss += loss.detach().float()``, an evaluation whose accuracy and F1 are computed over the
  whole evaluation set, and ``accelerator.log({"accuracy", "f1", "train_loss", "epoch"})``; a linear schedule with
  warm-up stepped after every update; the config's ``batch_size`` 16 is ``MAX_GPU_BATCH_SIZE``, so no
  accumulation). The port follows docs/trainer.md's table: accuracy ``self.log``-ged in ``validation_step`` (a mean
  over samples), F1 computed in ``on_validation_end(metrics)`` as ``metrics["f1"] = ...``, the training loss summed
  in ``training_step`` and ``self.log``-ged in ``on_epoch_end``.
- Lightning's ``GradientAccumulationScheduler``: Lightning-AI/pytorch-lightning,
  src/lightning/pytorch/callbacks/gradient_accumulation_scheduler.py (``scheduling={0: 3, 1: 2}``: 3 batches an
  update in epoch 0, 2 from epoch 1 on, set at each epoch's start) with ``gradient_clip_val`` and a ``StepLR``
  once an epoch, ``max_epochs`` and no ``max_steps``. The hand loop is Lightning's loop as docs/trainer.md
  describes it (no update spans two passes; a pass's last, shorter group divided by the pass's count too). The port
  sets ``self.grad_accum`` in ``on_epoch_start``, as the docs' Lightning table says.
- transformers' Trainer: huggingface/transformers, src/transformers/trainer.py (000945a9, ``_inner_training_loop``:
  each update's batches read ahead, a model taking no ``num_items_in_batch`` has its loss divided by
  ``current_gradient_accumulation_steps``, the group's batches, so a pass's last group of 1 by 1;
  ``accelerator.clip_grad_norm_``, ``learning_rate`` read before ``lr_scheduler.step()``, ``model.zero_grad()``;
  ``_maybe_log_save_evaluate`` every ``logging_steps=1``; after the loop ``train_loss``, the summed loss over the
  updates, in the metrics of ``self.log(metrics)``). The port undoes the Trainer's division as test_schedulers_real's
  timm port does, keeps the loop's sums in ``training_step`` and ``on_step_end``, and logs ``train_loss`` in
  ``on_fit_end``.
- diffusers' text-to-image fine-tuning: huggingface/diffusers, examples/text_to_image/train_text_to_image.py
  (``with accelerator.accumulate(unet)``: noise and timesteps drawn per micro-batch, ``DDPMScheduler.add_noise``,
  the MSE on the noise, ``accelerator.backward`` dividing by ``gradient_accumulation_steps``, clipping at 1.0 when
  ``sync_gradients``, the optimizer, scheduler and ``zero_grad`` acting on the micro-batch that ends a group or the
  pass; ``train_loss += avg_loss.item() / gradient_accumulation_steps`` logged at each update). A small MLP of the
  noisy latents and the timestep stands in for the UNet; the VAE and text encoder (frozen) are left out: the
  batches are latents. ``get_cosine_schedule_with_warmup`` from src/diffusers/optimization.py.
- build-nanogpt's log line: karpathy/build-nanogpt, train_gpt2.py (``loss_accum += loss.detach()`` over the
  micro-steps of ``loss / grad_accum_steps``; ``norm = clip_grad_norm_(...)``; ``lr = get_lr(step)``; printed every
  step), through test_build_nanogpt's model and port with bf16 autocast.

Sizes: a few batches of a few samples, models of a few dozen parameters, 2-3 epochs.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, StepLR
from torch.utils.data import DataLoader, TensorDataset

from safeloop import Trainer

from . import test_build_nanogpt as gpt
from . import test_schedulers_real as sched
from .harness import assert_same, checks, compare, fixed, labelled


class Recorder:
    """A logger object: what every log point wrote, with its step."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def values(self, name, after=0):
        return [m[name] for step, m in self.rows if name in m and step > after]


def hand_logs(make_model, hand, data):
    """What ``hand`` logged, run from the state ``compare`` runs it from."""
    torch.manual_seed(0)
    model = make_model()
    torch.manual_seed(1)
    return hand(model, data(model))


def port_logs(make_model, port, data, **settings):
    """The port run as ``compare`` runs it, its loggers a ``Recorder`` writing every step."""
    torch.manual_seed(0)
    model = make_model()
    recorder = Recorder()
    torch.manual_seed(1)
    trainer = port(model=model, train_data=data(model), device="cpu", progress=False, loggers=[recorder],
                   log_every=1, **settings)
    trainer.fit()
    return trainer, recorder


# -- Accelerate: accumulation over the items of the whole group ----------------------------------------------------
VOCAB, D, SEQ, PER_DEVICE, GA_BATCHES, GA, GA_EPOCHS, MAX_GRAD_NORM = 11, 8, 6, 2, 5, 2, 2, 1.0
GA_STEPS = GA_EPOCHS * math.ceil(GA_BATCHES / GA)


def fixed_cross_entropy(source, target, num_items_in_batch=None, ignore_index=-100, **kwargs):
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                    **kwargs):
    # Upcast to float if we need to compute the loss to avoid potential precision issues
    logits = logits.float()
    if shift_labels is None:
        # Shift so that tokens < n predict n
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    # Flatten the tokens
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    # Enable model parallelism
    shift_labels = shift_labels.to(logits.device)
    loss = fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index, **kwargs)
    return loss


class TinyCausalLM(nn.Module):
    """An embedding, a LayerNorm and a tied-free output layer for SmolLM-360M; the loss as transformers computes it."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, labels, num_items_in_batch=None):
        logits = self.lm_head(self.norm(self.embed_tokens(input_ids)))
        return ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=num_items_in_batch)


def padded_batches(n=GA_BATCHES):
    """``collate_fn``'s batches: ``max_length + 1`` tokens padded with the pad id 0, the labels the input shifted by one
    with padding as -100; the lengths differ, so that the groups hold different numbers of items."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        lengths = torch.randint(2, SEQ + 2, (PER_DEVICE,), generator=gen)
        ids = torch.randint(1, VOCAB, (PER_DEVICE, SEQ + 1), generator=gen) * (torch.arange(SEQ + 1) < lengths[:, None])
        labels = ids[:, 1:]
        out.append({"input_ids": ids[:, :-1], "labels": torch.where(labels == 0, -100, labels)})
    return out


def get_constant_schedule(optimizer, last_epoch=-1):
    return LambdaLR(optimizer, lambda _: 1, last_epoch=last_epoch)


def ga_optimizer(model):
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=2e-2)
    return optimizer, get_constant_schedule(optimizer=optimizer)


def ga_hand(model, train_dataloader, gradient_accumulation_steps=GA):
    optimizer, lr_scheduler = ga_optimizer(model)
    num_samples_in_epoch = len(train_dataloader)
    remainder = num_samples_in_epoch % gradient_accumulation_steps
    remainder = remainder if remainder != 0 else gradient_accumulation_steps
    total_gradient_updates = math.ceil(num_samples_in_epoch / gradient_accumulation_steps)
    logged = []
    for epoch in range(GA_EPOCHS):
        model.train()
        training_iterator = iter(train_dataloader)
        for update_step in range(total_gradient_updates):
            batch_samples = []
            num_batches_in_step = (
                gradient_accumulation_steps if update_step != (total_gradient_updates - 1) else remainder
            )
            for _ in range(num_batches_in_step):
                batch_samples += [next(training_iterator)]
            num_items_in_batch = sum([(batch["labels"].ne(-100)).sum() for batch in batch_samples]).sum().item()
            losses = []
            for i, batch in enumerate(batch_samples):
                loss = model(**batch, num_items_in_batch=num_items_in_batch)
                loss = loss * gradient_accumulation_steps * 1  # accelerator.num_processes
                (loss / gradient_accumulation_steps).backward()  # accelerator.backward(loss)
                losses.append(loss.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses = sum(losses).sum().item() / (1 * gradient_accumulation_steps)
            grad_norm = grad_norm.detach().item() if isinstance(grad_norm, torch.Tensor) else grad_norm
            logged.append({"train/grad_norm": grad_norm, "train/loss": losses})
    return logged


class ItemsCounted:
    """The batches of a pass, each given the ``num_items_in_batch`` of its group of ``accum`` (the pass's last group:
    the batches left), counted as the loop counts them before the group's forwards."""

    def __init__(self, batches, accum=GA):
        self.batches, self.accum = batches, accum

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for start in range(0, len(self.batches), self.accum):
            group = self.batches[start:start + self.accum]
            num_items_in_batch = sum([(batch["labels"].ne(-100)).sum() for batch in group]).sum().item()
            yield from ({**batch, "num_items_in_batch": num_items_in_batch} for batch in group)


class AccumulatedLM(Trainer):
    def configure_optimizers(self):
        optimizer, scheduler = ga_optimizer(self.model)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch):
        loss = self.model(batch["input_ids"], batch["labels"], num_items_in_batch=batch["num_items_in_batch"])
        return loss * self.grad_accum * 1  # the loop's `* gradient_accumulation_steps * num_processes`

    def on_before_optimizer_step(self, name, optimizer):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.log("train/grad_norm", torch.nn.utils.get_total_norm(grads))


def ga_data(model):
    return ItemsCounted(padded_batches())


@pytest.mark.parametrize("check", checks())
def test_accelerate_accumulation_over_the_items_of_the_whole_group(check):
    """huggingface/accelerate, examples/by_feature/gradient_accumulation_for_autoregressive_models.py."""
    compare(TinyCausalLM, lambda model, data: ga_hand(model, data.batches), AccumulatedLM, ga_data, check,
            steps=GA_STEPS, grad_accum=GA, grad_clip=MAX_GRAD_NORM, max_epochs=GA_EPOCHS)


def test_accelerate_accumulation_logs_the_grad_norm_and_the_full_groups_loss():
    """huggingface/accelerate, examples/by_feature/gradient_accumulation_for_autoregressive_models.py: the
    ``train/grad_norm`` of every update, and ``train/loss`` of the updates over a whole group of micro-batches."""
    hand = hand_logs(TinyCausalLM, lambda model, data: ga_hand(model, data.batches), ga_data)
    _, port = port_logs(TinyCausalLM, AccumulatedLM, ga_data, grad_accum=GA, grad_clip=MAX_GRAD_NORM,
                        max_epochs=GA_EPOCHS)
    assert port.values("train/grad_norm") == [row["train/grad_norm"] for row in hand]
    full = [i for i in range(GA_STEPS) if i % math.ceil(GA_BATCHES / GA) != math.ceil(GA_BATCHES / GA) - 1]
    assert [port.values("loss")[i] for i in full] == [hand[i]["train/loss"] for i in full]


def test_accelerate_accumulation_logs_the_mean_loss_of_a_pass_last_shorter_step():
    """huggingface/accelerate, examples/by_feature/gradient_accumulation_for_autoregressive_models.py: ``train/loss``
    of every update is what the loop back-propagated, ``sum(losses) / gradient_accumulation_steps``. docs/trainer.md
    (Accumulation): the Trainer logs the mean over the step's micro-batches, which on the pass's last step (one
    micro-batch of 2) is twice the loop's; elsewhere the same."""
    hand = hand_logs(TinyCausalLM, lambda model, data: ga_hand(model, data.batches), ga_data)
    _, port = port_logs(TinyCausalLM, AccumulatedLM, ga_data, grad_accum=GA, grad_clip=MAX_GRAD_NORM,
                        max_epochs=GA_EPOCHS)
    per_pass, short = math.ceil(GA_BATCHES / GA), GA / (GA_BATCHES % GA)
    assert port.values("loss") == [row["train/loss"] * (short if i % per_pass == per_pass - 1 else 1)
                                   for i, row in enumerate(hand)]


# -- timm: the rate logged before step_update ----------------------------------------------------------------------
def timm_logging_hand(model, loader):
    """train.py's ``train_one_epoch`` (test_schedulers_real's, with accumulation) and its log line, every update
    (``log_interval`` 1), before ``step_update``; ``main``'s ``lr_scheduler.step(epoch + 1, metric)``."""
    optimizer, lr_scheduler = sched.timm_optimizer(model, sched.timm_updates_per_epoch(loader), True)
    loss_fn = nn.CrossEntropyLoss()
    logged = []
    for epoch in range(sched.TIMM_EPOCHS):
        model.train()
        accum_steps = sched.TIMM_ACCUM
        last_accum_steps = len(loader) % accum_steps
        updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
        num_updates = epoch * updates_per_epoch
        last_batch_idx = len(loader) - 1
        last_batch_idx_to_accum = len(loader) - last_accum_steps
        optimizer.zero_grad()
        for batch_idx, (input, target) in enumerate(loader):
            last_batch = batch_idx == last_batch_idx
            need_update = last_batch or (batch_idx + 1) % accum_steps == 0
            update_idx = batch_idx // accum_steps
            if batch_idx >= last_batch_idx_to_accum:
                accum_steps = last_accum_steps
            loss = loss_fn(model(input), target)
            if accum_steps > 1:
                loss /= accum_steps
            loss.backward()
            if need_update:
                optimizer.step()
            if not need_update:
                continue
            num_updates += 1
            optimizer.zero_grad()
            if update_idx % 1 == 0:  # args.log_interval
                lrl = [param_group['lr'] for param_group in optimizer.param_groups]
                lr = sum(lrl) / len(lrl)
                logged.append(lr)
            lr_scheduler.step_update(num_updates=num_updates, metric=None)
        lr_scheduler.step(epoch + 1, sched.validate(model, sched.timm_val()))
    return logged


def test_timm_logs_the_rate_each_update_used():
    """huggingface/pytorch-image-models, train.py: the ``LR`` of the log line, every update."""
    data = fixed(labelled(sched.TIMM_BATCHES))
    hand = hand_logs(sched.classifier, timm_logging_hand, data)
    _, port = port_logs(sched.classifier, sched.TimmLoop, data, grad_accum=sched.TIMM_ACCUM,
                        max_epochs=sched.TIMM_EPOCHS)
    assert port.values("lr") == hand


@pytest.mark.parametrize("check", checks())
def test_timm_loop_with_its_log_line_trains_as_the_port(check):
    """huggingface/pytorch-image-models, train.py: the loop that logs trains as test_schedulers_real's port."""
    compare(sched.classifier, timm_logging_hand, sched.TimmLoop, fixed(labelled(sched.TIMM_BATCHES)), check,
            steps=sched.TIMM_STEPS, grad_accum=sched.TIMM_ACCUM)


# -- Accelerate: metrics of each epoch ----------------------------------------------------------------------------
TR_EPOCHS, TR_BATCHES, TR_WARMUP, TR_LR = 3, 5, 2, 2e-2


def binary_classifier():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def mrpc_like(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen), torch.randint(2, (8,), generator=gen)) for _ in range(n)]


def f1(predictions, references):
    """``evaluate``'s glue/mrpc F1 (scikit-learn's binary ``f1_score``): 2 TP / (2 TP + FP + FN)."""
    tp = int(((predictions == 1) & (references == 1)).sum())
    fp = int(((predictions == 1) & (references == 0)).sum())
    fn = int(((predictions == 0) & (references == 1)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    def lr_lambda(current_step: int):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(
            0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps))
        )

    return LambdaLR(optimizer, lr_lambda, last_epoch)


def tracking_optimizer(model, train_dataloader, gradient_accumulation_steps=1):
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=TR_LR)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=TR_WARMUP,
        num_training_steps=(len(train_dataloader) * TR_EPOCHS) // gradient_accumulation_steps)
    return optimizer, lr_scheduler


def tracking_hand(model, train_dataloader, eval_dataloader=None):
    eval_dataloader = eval_dataloader or mrpc_like(2, seed=8)
    gradient_accumulation_steps = 1  # batch_size 16 is not above MAX_GPU_BATCH_SIZE
    optimizer, lr_scheduler = tracking_optimizer(model, train_dataloader, gradient_accumulation_steps)
    logged = []
    for epoch in range(TR_EPOCHS):
        model.train()
        total_loss = 0
        for step, batch in enumerate(train_dataloader):
            inputs, labels = batch
            loss = F.cross_entropy(model(inputs), labels)
            total_loss += loss.detach().float()
            loss = loss / gradient_accumulation_steps
            loss.backward()
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        predictions, references = [], []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                logits = model(batch[0])
            predictions.append(logits.argmax(dim=-1))
            references.append(batch[1])
        predictions, references = torch.cat(predictions), torch.cat(references)
        eval_metric = {"accuracy": int((predictions == references).sum()) / len(references),
                       "f1": f1(predictions, references)}
        logged.append({"accuracy": eval_metric["accuracy"], "f1": eval_metric["f1"], "train_loss": float(total_loss),
                       "epoch": epoch})
    return logged


class Tracking(Trainer):
    def configure_optimizers(self):
        optimizer, scheduler = tracking_optimizer(self.model, self.train_data)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_epoch_start(self):
        self.total_loss = 0

    def training_step(self, batch):
        inputs, labels = batch
        loss = F.cross_entropy(self.model(inputs), labels)
        self.total_loss += loss.detach().float()
        return loss

    def on_epoch_end(self):
        self.log("train_loss", self.total_loss)

    def validation_step(self, batch):
        inputs, labels = batch
        logits = self.model(inputs)
        predictions = logits.argmax(dim=-1)
        self.predictions.append(predictions)
        self.references.append(labels)
        self.log("accuracy", (predictions == labels).float().mean())
        return F.cross_entropy(logits, labels)

    def on_fit_start(self):
        self.predictions, self.references = [], []

    def on_validation_end(self, metrics):
        metrics["f1"] = f1(torch.cat(self.predictions), torch.cat(self.references))
        self.predictions, self.references = [], []


TRACKING = dict(val_data=mrpc_like(2, seed=8), val_every=TR_BATCHES)


@pytest.mark.parametrize("check", checks())
def test_accelerate_tracking_example_trains_as_its_port(check):
    """huggingface/accelerate, examples/by_feature/tracking.py."""
    compare(binary_classifier, tracking_hand, Tracking, fixed(mrpc_like(TR_BATCHES, seed=3)), check,
            steps=TR_EPOCHS * TR_BATCHES, **TRACKING)


def test_accelerate_tracking_example_logs_each_epochs_accuracy_and_training_loss():
    """huggingface/accelerate, examples/by_feature/tracking.py: ``accuracy`` and ``train_loss`` of every epoch."""
    data = fixed(mrpc_like(TR_BATCHES, seed=3))
    hand = hand_logs(binary_classifier, tracking_hand, data)
    trainer, port = port_logs(binary_classifier, Tracking, data, max_epochs=TR_EPOCHS, **TRACKING)
    assert port.values("accuracy") == [row["accuracy"] for row in hand]
    assert port.values("train_loss") == [row["train_loss"] for row in hand]
    assert [m["f1"] for step, m in trainer.state.val_history if step > 0] == [row["f1"] for row in hand]


def test_accelerate_tracking_example_logs_each_epochs_f1():
    """huggingface/accelerate, examples/by_feature/tracking.py: ``f1`` of every epoch."""
    data = fixed(mrpc_like(TR_BATCHES, seed=3))
    hand = hand_logs(binary_classifier, tracking_hand, data)
    _, port = port_logs(binary_classifier, Tracking, data, max_epochs=TR_EPOCHS, **TRACKING)
    assert port.values("f1") == [row["f1"] for row in hand]


# -- Lightning: an accumulation count per epoch, max_epochs --------------------------------------------------------
SCHEDULING, LS_EPOCHS, LS_CLIP = {0: 3, 1: 2}, 3, 0.5


def get_accumulate_grad_batches(epoch, scheduling=SCHEDULING):
    accumulate_grad_batches = 1
    for iter_epoch in reversed(sorted(scheduling)):
        if epoch >= iter_epoch:
            accumulate_grad_batches = scheduling[iter_epoch]
            break
    return accumulate_grad_batches


def scheduled_optimizer(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return optimizer, StepLR(optimizer, step_size=1, gamma=0.5)


def scheduled_hand(model, loader):
    """Lightning's loop: each pass grouped by that epoch's count, the last group shorter and divided by it too;
    ``gradient_clip_val`` before each step; the epoch's ``StepLR`` at the pass's end."""
    optimizer, scheduler = scheduled_optimizer(model)
    for epoch in range(LS_EPOCHS):
        accumulate = get_accumulate_grad_batches(epoch)
        for i, (x, y) in enumerate(loader):
            (F.cross_entropy(model(x), y) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i == len(loader) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), LS_CLIP)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()


class Scheduled(Trainer):
    def configure_optimizers(self):
        optimizer, scheduler = scheduled_optimizer(self.model)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def on_epoch_start(self):
        self.grad_accum = get_accumulate_grad_batches(self.state.epoch)

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


def shuffled(model):
    x, y = (torch.cat(t) for t in zip(*labelled(5)))
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


@pytest.mark.parametrize("check", checks())
def test_lightning_accumulation_schedule_over_max_epochs(check):
    """Lightning-AI/pytorch-lightning, src/lightning/pytorch/callbacks/gradient_accumulation_scheduler.py, with
    ``max_epochs=3`` alone: 2 updates in epoch 0 (3 + 2 batches), 3 in each later one (2 + 2 + 1)."""
    torch.manual_seed(0)
    ref = sched.classifier()
    ours = copy.deepcopy(ref)
    torch.manual_seed(1)
    scheduled_hand(ref, shuffled(ref))
    torch.manual_seed(1)
    trainer = Scheduled(model=ours, train_data=shuffled(ours), max_epochs=LS_EPOCHS, grad_clip=LS_CLIP,
                        device="cpu", progress=False, loggers=(), guard={"check": check})
    trainer.fit()
    assert (trainer.state.step, trainer.state.epoch) == (2 + 3 + 3, LS_EPOCHS)
    assert trainer.schedulers["optimizer"].last_epoch == LS_EPOCHS
    assert_same(ours, ref)


# -- build-nanogpt: the loss averaged over the micro-steps, the norm and the rate, every step ------------------------
def gpt_logging_hand(model, train_loader):
    """test_build_nanogpt's ``gpt_hand`` with train_gpt2.py's log line (``loss_accum``, ``lr``, ``norm``)."""
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=gpt.device_type)
    logged = []
    for step in range(gpt.max_steps):
        model.train()
        optimizer.zero_grad()
        loss_accum = 0.0
        for micro_step in range(gpt.GRAD_ACCUM_STEPS):
            x, y = train_loader.next_batch()
            with torch.autocast(device_type=gpt.device_type, dtype=torch.bfloat16):
                logits, loss = model(x, y)
            loss = loss / gpt.GRAD_ACCUM_STEPS
            loss_accum += loss.detach()
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = gpt.get_lr(step)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        optimizer.step()
        logged.append({"loss": loss_accum.item(), "lr": lr, "norm": norm.item()})
    return logged


class GPTLogging(gpt.GPTTrainer):
    def on_before_optimizer_step(self, name, optimizer):
        super().on_before_optimizer_step(name, optimizer)
        self.log("norm", torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters()
                                                        if p.grad is not None]))


def test_build_nanogpt_logs_the_loss_over_the_micro_steps_the_norm_and_the_rate():
    """karpathy/build-nanogpt, train_gpt2.py: the loss averaged over the accumulated micro-steps, the norm before
    clipping and the rate, every step (both AdamW groups get the same rate)."""
    data = lambda model: gpt.MicroBatches()  # noqa: E731
    hand = hand_logs(gpt.make_gpt, gpt_logging_hand, data)
    _, port = port_logs(gpt.make_gpt, GPTLogging, data, max_steps=gpt.max_steps, precision="bf16",
                        grad_accum=gpt.GRAD_ACCUM_STEPS, grad_clip=1.0)
    assert port.values("loss") == [row["loss"] for row in hand]
    assert port.values("norm") == [row["norm"] for row in hand]
    assert port.values("lr_0") == port.values("lr_1") == [row["lr"] for row in hand]


# -- transformers' Trainer: its loop, and the training loss it logs when training ends ----------------------------
HF_BATCHES, HF_GA, HF_EPOCHS, HF_LR, HF_WARMUP, HF_MAX_GRAD_NORM = 5, 2, 2, 5e-2, 1, 1.0
HF_STEPS = HF_EPOCHS * math.ceil(HF_BATCHES / HF_GA)


def hf_optimizer(model, max_steps=HF_STEPS):
    optimizer = torch.optim.AdamW(model.parameters(), lr=HF_LR, weight_decay=0.0)
    return optimizer, get_linear_schedule_with_warmup(optimizer, HF_WARMUP, max_steps)


def hf_trainer_hand(model, train_dataloader, gradient_accumulation_steps=HF_GA, logging_steps=1):
    """``_inner_training_loop`` for a model that takes no ``num_items_in_batch`` (its loss divided by
    ``current_gradient_accumulation_steps``, the group's batches), one process, no callbacks, evaluation or saving;
    ``_maybe_log_save_evaluate``'s logs; the ``train_loss`` of the metrics logged at the end."""
    len_dataloader = len(train_dataloader)
    num_update_steps_per_epoch = len_dataloader // gradient_accumulation_steps + int(
        len_dataloader % gradient_accumulation_steps > 0)
    max_steps = math.ceil(HF_EPOCHS * num_update_steps_per_epoch)
    optimizer, lr_scheduler = hf_optimizer(model, max_steps)
    tr_loss = torch.tensor(0.0)
    total_loss_scalar, globalstep_last_logged, global_step = 0.0, 0, 0
    model.zero_grad()
    log_history = []
    for epoch in range(HF_EPOCHS):
        steps_in_epoch = len(train_dataloader)
        step = -1
        epoch_iterator = iter(train_dataloader)
        remainder = steps_in_epoch % gradient_accumulation_steps
        if remainder == 0:
            remainder = gradient_accumulation_steps
        update_step = -1
        total_updates = steps_in_epoch // gradient_accumulation_steps + int(remainder < gradient_accumulation_steps)
        for _ in range(total_updates):
            update_step += 1
            num_batches = gradient_accumulation_steps if update_step != (total_updates - 1) else remainder
            batch_samples = [next(epoch_iterator) for _ in range(num_batches)]  # get_batch_samples: no "labels"
            current_gradient_accumulation_steps = len(batch_samples)
            for i, inputs in enumerate(batch_samples):
                step += 1
                do_sync_step = (step + 1) % gradient_accumulation_steps == 0 or (step + 1) == steps_in_epoch
                model.train()  # training_step
                loss = F.cross_entropy(model(inputs[0]), inputs[1])
                loss = loss / current_gradient_accumulation_steps
                loss.backward()
                tr_loss = tr_loss + loss.detach()
                if do_sync_step:
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), HF_MAX_GRAD_NORM)
                    optimizer.step()
                    learning_rate = lr_scheduler.get_last_lr()[0]  # get leaning rate before update
                    lr_scheduler.step()
                    model.zero_grad()
                    global_step += 1
                    if global_step % logging_steps == 0:  # _maybe_log_save_evaluate
                        tr_loss_scalar = tr_loss.mean().item()
                        tr_loss -= tr_loss
                        log_history.append({"grad_norm": grad_norm.item(), "learning_rate": learning_rate})
                        total_loss_scalar += tr_loss_scalar
                        globalstep_last_logged = global_step
    total_loss_scalar += tr_loss.item()  # add remaining tr_loss
    log_history.append({"train_loss": total_loss_scalar / max(global_step, 0.001)})
    return log_history


class HFTrainerPort(Trainer):
    """The loss divided by the group's batches, as the loop does (the Trainer divides by ``grad_accum``: undone), and
    the loop's running sums of it, logged at the end of training."""

    def configure_optimizers(self):
        # docs/trainer.md's stand-in for Lightning's estimated_stepping_batches
        updates = self.max_epochs * math.ceil(len(self.train_data) / self.grad_accum)
        optimizer, scheduler = hf_optimizer(self.model, min(updates, self.max_steps or updates))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self):
        self.tr_loss, self.total_loss_scalar = torch.tensor(0.0), 0.0

    def training_step(self, batch):
        loss = F.cross_entropy(self.model(batch[0]), batch[1])
        left = len(self.train_data) % self.grad_accum
        current = left if left and self.state.batch_in_epoch > len(self.train_data) - left else self.grad_accum
        self.tr_loss = self.tr_loss + (loss / current).detach()
        return loss * self.grad_accum / current

    def on_before_optimizer_step(self, name, optimizer):
        self.log("grad_norm", torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters()
                                                             if p.grad is not None]))

    def on_step_end(self, losses):
        self.total_loss_scalar += self.tr_loss.mean().item()
        self.tr_loss = self.tr_loss - self.tr_loss

    def on_fit_end(self):
        self.total_loss_scalar += self.tr_loss.item()
        self.log("train_loss", self.total_loss_scalar / max(self.state.step, 0.001))


def hf_data(model):
    return labelled(HF_BATCHES)


@pytest.mark.parametrize("check", checks())
def test_transformers_trainer_loop_with_a_shorter_last_group(check):
    """huggingface/transformers, src/transformers/trainer.py (000945a9), ``_inner_training_loop``."""
    compare(sched.classifier, hf_trainer_hand, HFTrainerPort, hf_data, check, steps=HF_STEPS, grad_accum=HF_GA,
            grad_clip=HF_MAX_GRAD_NORM, max_epochs=HF_EPOCHS)


def test_transformers_trainer_logs_the_rate_before_the_scheduler_steps_and_the_grad_norm():
    """huggingface/transformers, src/transformers/trainer.py: ``learning_rate`` and ``grad_norm`` every update
    (``logging_steps=1``)."""
    hand = hand_logs(sched.classifier, hf_trainer_hand, hf_data)[:-1]
    _, port = port_logs(sched.classifier, HFTrainerPort, hf_data, grad_accum=HF_GA, grad_clip=HF_MAX_GRAD_NORM,
                        max_epochs=HF_EPOCHS)
    assert port.values("lr") == [row["learning_rate"] for row in hand]
    assert port.values("grad_norm") == [row["grad_norm"] for row in hand]


def test_transformers_trainer_logs_the_training_loss_when_training_ends():
    """huggingface/transformers, src/transformers/trainer.py: ``metrics["train_loss"]``, logged by ``self.log(metrics)``
    after the loop."""
    hand = hand_logs(sched.classifier, hf_trainer_hand, hf_data)[-1]
    trainer, port = port_logs(sched.classifier, HFTrainerPort, hf_data, grad_accum=HF_GA,
                              grad_clip=HF_MAX_GRAD_NORM, max_epochs=HF_EPOCHS)
    assert trainer.total_loss_scalar / trainer.state.step == hand["train_loss"]  # the port computes the same
    assert port.values("train_loss") == [hand["train_loss"]]


# -- diffusers: text-to-image fine-tuning under accelerator.accumulate ---------------------------------------------
DF_BATCHES, DF_BSZ, DF_GA, DF_EPOCHS, DF_WARMUP, DF_T = 5, 2, 2, 2, 1, 1000
DF_STEPS = DF_EPOCHS * math.ceil(DF_BATCHES / DF_GA)


class DDPMScheduler:
    """schedulers/scheduling_ddpm.py: ``beta_schedule="linear"`` betas, ``alphas_cumprod`` and ``add_noise``."""

    def __init__(self, num_train_timesteps=DF_T, beta_start=0.0001, beta_end=0.02):
        self.num_train_timesteps = num_train_timesteps
        self.betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)

    def add_noise(self, original_samples, noise, timesteps):
        alphas_cumprod = self.alphas_cumprod.to(dtype=original_samples.dtype)
        sqrt_alpha_prod = alphas_cumprod[timesteps] ** 0.5
        sqrt_alpha_prod = sqrt_alpha_prod.flatten()
        while len(sqrt_alpha_prod.shape) < len(original_samples.shape):
            sqrt_alpha_prod = sqrt_alpha_prod.unsqueeze(-1)
        sqrt_one_minus_alpha_prod = (1 - alphas_cumprod[timesteps]) ** 0.5
        sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.flatten()
        while len(sqrt_one_minus_alpha_prod.shape) < len(original_samples.shape):
            sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.unsqueeze(-1)
        return sqrt_alpha_prod * original_samples + sqrt_one_minus_alpha_prod * noise


class TinyDenoiser(nn.Module):
    """The UNet: the noisy latents and the timestep in, the predicted noise out."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, noisy_latents, timesteps):
        return self.net(torch.cat([noisy_latents, timesteps[:, None].float() / DF_T], dim=1))


def get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, num_cycles=0.5, last_epoch=-1):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))

    return LambdaLR(optimizer, lr_lambda, last_epoch)


def diffusers_optimizer(model, max_train_steps=DF_STEPS):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-08)
    return optimizer, get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=DF_WARMUP * 1,
                                                      num_training_steps=max_train_steps * 1)


def latents(n=DF_BATCHES):
    gen = torch.Generator().manual_seed(12)
    return [torch.randn(DF_BSZ, 4, generator=gen) for _ in range(n)]


def diffusers_hand(unet, train_dataloader, gradient_accumulation_steps=DF_GA, max_grad_norm=1.0,
                   max_train_steps=None):
    """``main``'s loop, ``accelerator.accumulate(unet)`` written out for one process: every loss divided by
    ``gradient_accumulation_steps`` (``accelerator.backward``); the optimizer, the scheduler and ``zero_grad`` act on
    the micro-batch that ends a group of that many or the pass (``sync_gradients``); ``train_loss`` logged then."""
    noise_scheduler = DDPMScheduler()
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / gradient_accumulation_steps)
    if max_train_steps is None:
        max_train_steps = DF_EPOCHS * num_update_steps_per_epoch
    optimizer, lr_scheduler = diffusers_optimizer(unet, max_train_steps)
    num_train_epochs = math.ceil(max_train_steps / num_update_steps_per_epoch)
    global_step = 0
    logged = []
    for epoch in range(num_train_epochs):
        unet.train()
        train_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            sync_gradients = (step + 1) % gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1
            latents = batch
            noise = torch.randn_like(latents)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.num_train_timesteps, (bsz,), device=latents.device)
            timesteps = timesteps.long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            target = noise
            model_pred = unet(noisy_latents, timesteps)
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
            avg_loss = loss.repeat(DF_BSZ).mean()
            train_loss += avg_loss.item() / gradient_accumulation_steps
            (loss / gradient_accumulation_steps).backward()
            if sync_gradients:
                torch.nn.utils.clip_grad_norm_(unet.parameters(), max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                global_step += 1
                logged.append({"train_loss": train_loss, "step": global_step})
                train_loss = 0.0
            if global_step >= max_train_steps:
                break
    return logged


class TextToImage(Trainer):
    def configure_optimizers(self):
        optimizer, scheduler = diffusers_optimizer(self.model, self.max_steps)
        self.noise_scheduler = DDPMScheduler()
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, latents):
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, self.noise_scheduler.num_train_timesteps, (latents.shape[0],)).long()
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        return F.mse_loss(self.model(noisy_latents, timesteps).float(), noise.float(), reduction="mean")


@pytest.mark.parametrize("max_train_steps", [None, 4], ids=["from_the_epochs", "mid_pass"])
@pytest.mark.parametrize("check", checks())
def test_diffusers_text_to_image_under_accelerate_accumulation(check, max_train_steps):
    """huggingface/diffusers, examples/text_to_image/train_text_to_image.py; ``--max_train_steps 4`` makes
    ``num_train_epochs`` 2 and stops at its ``break`` after the second pass's first 4 micro-batches."""
    compare(TinyDenoiser, lambda unet, data: diffusers_hand(unet, data, max_train_steps=max_train_steps),
            TextToImage, fixed(latents()), check, steps=max_train_steps or DF_STEPS, grad_accum=DF_GA, grad_clip=1.0)


def test_diffusers_text_to_image_logs_the_loss_of_each_update():
    """huggingface/diffusers, examples/text_to_image/train_text_to_image.py: ``train_loss`` of every update, summed
    as ``avg_loss.item() / gradient_accumulation_steps`` in float64; the Trainer's is the float32 mean over the
    micro-batches (docs/trainer.md, Accumulation): equal to rounding, but on a pass's last step (1 micro-batch of 2),
    where it is twice the loop's."""
    data = fixed(latents())
    hand = hand_logs(TinyDenoiser, diffusers_hand, data)
    _, port = port_logs(TinyDenoiser, TextToImage, data, max_steps=DF_STEPS, grad_accum=DF_GA, grad_clip=1.0)
    per_pass, short = math.ceil(DF_BATCHES / DF_GA), DF_GA / (DF_BATCHES % DF_GA)
    assert port.values("loss") == pytest.approx([row["train_loss"] * (short if i % per_pass == per_pass - 1 else 1)
                                                 for i, row in enumerate(hand)], rel=1e-6)
