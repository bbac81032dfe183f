"""nanoGPT's float16 training loop: karpathy/nanoGPT at commit e2221318e607eb5ee0669d6b7641af25a2111545, train.py
(``ctx``, ``scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))``, ``estimate_loss``, ``get_lr`` and the
training loop).

Every micro-step's forward and its ``loss / gradient_accumulation_steps`` run under ``ctx`` (autocast); then
``scaler.scale(loss).backward()``; after the micro-steps ``scaler.unscale_(optimizer)``,
``clip_grad_norm_(model.parameters(), grad_clip)``, ``scaler.step(optimizer)``, ``scaler.update()`` and
``optimizer.zero_grad(set_to_none=True)``. The lr is assigned from ``get_lr(iter_num)`` (warm-up ``(it + 1) /
(warmup_iters + 1)``, cosine decay) at the top of each iteration, and the loop runs ``max_iters + 1`` iterations.
``estimate_loss`` evaluates under ``torch.no_grad()``, ``model.eval()`` and ``ctx``.

Changes for a seconds-long test: the model is build-nanogpt's GPT (``test_build_nanogpt``: nanoGPT's architecture
without dropout or biases options, 2 layers, 2 heads, ``n_embd`` 8, a vocabulary of 32, ``block_size`` 8) and its
``configure_optimizers`` (AdamW in two groups, betas (0.9, 0.95)); ``batch_size`` 2, ``gradient_accumulation_steps``
2, ``max_iters`` 5, ``warmup_iters`` 2, ``lr_decay_iters`` 5; ``get_batch`` draws from a seeded generator over a
random token tensor (``train.bin``) instead of the global one; the device is the CPU, so ``ctx`` is
``torch.autocast(device_type="cpu", dtype=torch.float16)`` and the scaler ``torch.amp.GradScaler("cpu")``; no DDP,
compile, logging or checkpoints. ``dtype='bfloat16'`` (the scaler disabled) is run too.

The port: ``precision="16-mixed"`` (``"bf16-mixed"``), ``grad_accum=2``, ``grad_clip=1.0``, the lr assigned in
``on_step_start``; validation through ``val_data`` and the default ``validation_step`` (under the same autocast).
Resumed from a checkpoint midway, the port trains as the run that never stopped, the scaler's growth tracker
included. With ``precision="bf16-true"`` the port matches the same loop with the model cast to bfloat16
(``model.to(dtype=torch.bfloat16)`` before the optimizer is made, no autocast and no scaler), the parameters as
Lightning's ``bf16-true`` holds them (lightning/fabric/plugins/precision/half.py, ``HalfPrecision.convert_module``).
nanoGPT resumes (``init_from='resume'``) under any ``dtype``: its checkpoint holds no scaler. The Trainer refuses a
checkpoint saved with another precision's GradScaler (or without one), naming both precisions.
"""
import math

import pytest
import torch

from safeloop import CheckpointError, Trainer

from . import test_build_nanogpt as gpt2
from .harness import assert_same, checks, compare, compare_runs

batch_size, block_size, gradient_accumulation_steps = 2, gpt2.T, 2
learning_rate, min_lr = 6e-4, 6e-5
max_iters, warmup_iters, lr_decay_iters = 5, 2, 5
weight_decay, grad_clip = 1e-1, 1.0
device_type = "cpu"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
PRECISIONS = {"float16": "16-mixed", "bfloat16": "bf16-mixed"}


def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


class Data:
    """``train.bin`` as a token tensor; ``get_batch`` from a seeded generator. Iterated, the batches the loop reads,
    in its order: one ``get_batch`` before the loop and one after each micro-step's forward."""

    def __init__(self, seed=11):
        self.data = torch.randint(gpt2.GPTConfig.vocab_size, (200,), generator=torch.Generator().manual_seed(seed))
        self.seed = seed
        self.scales = []

    def reset(self):
        self.gen = torch.Generator().manual_seed(self.seed)

    def get_batch(self):
        ix = torch.randint(len(self.data) - block_size, (batch_size,), generator=self.gen)
        x = torch.stack([self.data[i:i + block_size] for i in ix])
        y = torch.stack([self.data[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    def __iter__(self):
        self.reset()
        return iter([self.get_batch() for _ in range((max_iters + 1) * gradient_accumulation_steps)])


def nanogpt_hand(model, data, dtype="float16"):
    ctx = torch.amp.autocast(device_type=device_type, dtype=DTYPES[dtype])
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))  # torch.cuda.amp.GradScaler(...)
    optimizer = model.configure_optimizers(weight_decay, learning_rate, device_type)
    data.reset()
    X, Y = data.get_batch()  # fetch the very first batch
    iter_num = 0
    while True:
        # determine and set the learning rate for this iteration
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
            X, Y = data.get_batch()
            # backward pass, with gradient scaling if training in fp16
            scaler.scale(loss).backward()
        # clip the gradient
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        # step the optimizer and scaler if training in fp16
        scaler.step(optimizer)
        scaler.update()
        data.scales.append(scaler.get_scale())
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        # termination conditions
        if iter_num > max_iters:
            break


def nanogpt_bf16_hand(model, data):
    nanogpt_hand(model, data, dtype="bfloat16")


class NanoGPT(Trainer):
    def configure_optimizers(self):
        return self.model.configure_optimizers(weight_decay, learning_rate, device_type)

    def training_step(self, batch):
        X, Y = batch
        logits, loss = self.model(X, Y)
        return loss

    def on_step_start(self):
        lr = get_lr(self.state.step)
        for param_group in self.optimizers["optimizer"].param_groups:
            param_group['lr'] = lr

    def on_step_end(self, losses):
        if self.scaler is not None:
            self.train_data.scales.append(self.scaler.get_scale())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("check", checks())
def test_nanogpt_with_a_grad_scaler_accumulation_and_clipping(check, dtype):
    runs = compare_runs(lambda: gpt2.GPT(gpt2.GPTConfig()), nanogpt_hand if dtype == "float16" else nanogpt_bf16_hand,
                        NanoGPT, Data, check, steps=max_iters + 1, precision=PRECISIONS[dtype],
                        grad_accum=gradient_accumulation_steps, grad_clip=grad_clip)
    hand, watched, port = (run.scales for run in runs)
    assert watched == hand
    if dtype == "float16":
        assert port == hand and len(hand) == max_iters + 1


@torch.no_grad()
def estimate_loss(model, batches, dtype):
    ctx = torch.amp.autocast(device_type=device_type, dtype=DTYPES[dtype])
    model.eval()
    losses = torch.zeros(len(batches))
    for k, (X, Y) in enumerate(batches):
        with ctx:
            logits, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return losses


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_nanogpt_validation_runs_under_the_same_autocast(dtype):
    torch.manual_seed(0)
    model = gpt2.GPT(gpt2.GPTConfig())
    val = Data(seed=12)
    val.reset()
    batches = [val.get_batch() for _ in range(4)]
    trainer = NanoGPT(model=model, train_data=Data(), val_data=batches, max_steps=2, device="cpu", progress=False,
                      loggers=(), precision=PRECISIONS[dtype], grad_accum=gradient_accumulation_steps)
    trainer.fit()
    (_, metrics) = trainer.state.val_history[-1]
    ours = estimate_loss(model, batches, dtype)
    assert metrics["val_loss"] == sum(float(v) * batch_size for v in ours) / (batch_size * len(batches))
    with torch.no_grad():
        full = [float(model(X, Y)[1]) for X, Y in batches]
    assert full != ours.tolist(), "autocast changed no validation loss: the comparison would prove nothing"


def test_nanogpt_float16_resumed_midway_keeps_the_scalers_growth_tracker(tmp_path):
    from .test_resume_ports import straight_and_resumed
    straight, resumed = straight_and_resumed(tmp_path, lambda: gpt2.GPT(gpt2.GPTConfig()), NanoGPT,
                                             lambda model: Data(), max_iters + 1, 3, precision="16-mixed",
                                             grad_accum=gradient_accumulation_steps, grad_clip=grad_clip)
    assert_same(resumed.model, straight.model)
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    # no update overflowed: the growth tracker counted every one, across the resume
    assert straight.scaler.state_dict()["_growth_tracker"] == max_iters + 1


def nanogpt_bf16_true_hand(model, data):
    """The loop with the model's parameters themselves in bfloat16 (Lightning's ``bf16-true``: HalfPrecision casts
    the module and the floating inputs; the token ids stay integers), no autocast, no scaler."""
    model.to(dtype=torch.bfloat16)
    optimizer = model.configure_optimizers(weight_decay, learning_rate, device_type)
    data.reset()
    X, Y = data.get_batch()
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        for micro_step in range(gradient_accumulation_steps):
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = data.get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num > max_iters:
            break


@pytest.mark.parametrize("check", checks())
def test_nanogpt_with_bf16_parameters(check):
    compare(lambda: gpt2.GPT(gpt2.GPTConfig()), nanogpt_bf16_true_hand, NanoGPT, lambda model: Data(), check,
            steps=max_iters + 1, precision="bf16-true", grad_accum=gradient_accumulation_steps, grad_clip=grad_clip)


def resume_in(tmp_path, saved, resumed):
    def run(precision, steps, resume=None):
        torch.manual_seed(0)
        model = gpt2.GPT(gpt2.GPTConfig())
        trainer = NanoGPT(model=model, train_data=Data(), max_steps=steps, device="cpu", progress=False, loggers=(),
                          checkpoint={"dir": str(tmp_path)}, resume=resume, precision=precision,
                          grad_accum=gradient_accumulation_steps)
        trainer.fit()
    run(saved, 2)
    with pytest.raises(CheckpointError) as caught:
        run(resumed, 4, resume="auto")
    return str(caught.value)


def test_a_float16_run_resumed_in_bf16_is_refused_naming_both(tmp_path):
    said = resume_in(tmp_path, "16-mixed", "bf16-mixed")
    assert "was saved with a GradScaler (precision 16) and this run has none: resume with the precision it was " \
           "saved with" in said, said


def test_a_float32_run_resumed_in_float16_is_refused_naming_both(tmp_path):
    said = resume_in(tmp_path, "32", "16-mixed")
    assert "was saved without a GradScaler (precision 32 or bf16) and this run has one (precision 16)" in said, said
