"""Ports of real hand-written training loops: each trains bit for bit as the loop it replaces.

Each test copies one loop's conventions from a public training script (named in its docstring), runs it on a
tiny seeded model and data, runs the natural port to ``safeloop.Trainer``, and compares every parameter and
buffer with ``torch.equal`` and the learning rate of every update. Where a port cannot match (a loop that validates
without ``fork_rng``, ``zero_grad(set_to_none=False)``, losses summed by hand and a returned dict), docs/trainer.md
says so and what to write instead.
"""
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safeloop import ConfigError, Trainer


def dataset(n=22, d=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=gen), torch.randn(n, 1, generator=gen))


def net(dropout=0.0, batch_norm=False, width=8):
    torch.manual_seed(0)
    layers = [nn.Linear(6, width)] + ([nn.BatchNorm1d(width)] if batch_norm else [])
    return nn.Sequential(*layers, nn.Tanh(), nn.Dropout(dropout), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1))


def assert_same(hand: nn.Module, port: nn.Module) -> None:
    a, b = hand.state_dict(), port.state_dict()
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"the port's {differ} differ from the hand-written loop's"


def decay_groups(model, weight_decay=0.1):
    """nanoGPT's configure_optimizers (and torchvision's set_weight_decay): matrices decay, biases and norms don't."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class Regression(Trainer):
    lrs: list

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def on_before_optimizer_step(self, name, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def port(cls=Regression, **kwargs):
    trainer = cls(progress=False, device="cpu", **kwargs)
    trainer.lrs = []
    return trainer


@pytest.mark.parametrize("accum", [3, 5])
def test_accumulation_with_the_tail_of_each_epoch_and_a_warmup_schedule_per_update(accum):
    """meta-llama/llama-recipes, src/llama_recipes/utils/train_utils.py (and transformers' ``run_*_no_trainer.py``
    before ``accelerator.accumulate``): ``loss = loss / gradient_accumulation_steps``; step, schedule and
    ``zero_grad`` when ``(step + 1) % N == 0 or step == len(train_dataloader) - 1``; a linear warmup and decay
    (``get_linear_schedule_with_warmup``, a LambdaLR) stepped per update; SGD with Nesterov momentum and weight
    decay; dropout and a shuffled loader drawing from the global generator."""
    ds, epochs, batch = dataset(), 2, 2
    updates = epochs * math.ceil(math.ceil(len(ds) / batch) / accum)

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * max(0.0, 1 - s / updates))

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)

    hand = net(dropout=0.3)
    opt, lrs = sgd(hand.parameters()), []
    sched = schedule(opt)
    torch.manual_seed(5)
    train_dataloader = DataLoader(ds, batch_size=batch, shuffle=True)
    for _ in range(epochs):
        hand.train()
        for step, (x, y) in enumerate(train_dataloader):
            loss = F.mse_loss(hand(x), y)
            loss = loss / accum
            loss.backward()
            if (step + 1) % accum == 0 or step == len(train_dataloader) - 1:
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
                opt.zero_grad()

    model = net(dropout=0.3)
    torch.manual_seed(5)
    trainer = port(model=model, train_data=DataLoader(ds, batch_size=batch, shuffle=True), optimizer=sgd,
                   scheduler=schedule, grad_accum=accum, max_epochs=epochs)
    trainer.fit()
    assert trainer.state.step == updates
    assert trainer.lrs == lrs and lrs[0] == pytest.approx(0.1 / 3)  # the first update takes the warmup's first lr
    assert_same(hand, model)


def test_nanogpt_loop_lr_set_by_hand_accumulation_and_clipping_over_model_parameters():
    """karpathy/nanoGPT, train.py: ``lr = get_lr(iter_num)`` written into every parameter group before the
    micro-steps; ``loss = loss / gradient_accumulation_steps`` (5 here, not a power of two); AdamW with
    betas (0.9, 0.95) over decay / no-decay groups; ``scaler.unscale_(optimizer)`` and
    ``clip_grad_norm_(model.parameters(), grad_clip)``; ``zero_grad(set_to_none=True)`` after the step.
    The port sets the lr in ``on_step_start`` and clips over ``model.parameters()`` in
    ``on_before_optimizer_step``, as the source does (``grad_clip=`` clips in the same order: see
    ``test_grad_clip_with_decay_groups_matches_clipping_over_model_parameters``)."""
    accum, max_iters, warmup, lr_max, lr_min, clip = 5, 6, 2, 6e-3, 6e-4, 0.05
    ds = dataset(n=max_iters * accum * 2)
    batches = list(DataLoader(ds, batch_size=2))

    def get_lr(it):
        if it < warmup:
            return lr_max * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (max_iters - warmup)
        return lr_min + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr_max - lr_min)

    def adamw(model):
        return torch.optim.AdamW(decay_groups(model), lr=lr_max, betas=(0.9, 0.95))

    hand = net(width=16)
    optimizer, lrs = adamw(hand), []
    data = iter(batches)
    for iter_num in range(max_iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for _ in range(accum):
            x, y = next(data)
            loss = F.mse_loss(hand(x), y) * 50
            loss = loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(hand.parameters(), clip)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    class NanoGPT(Regression):
        def training_step(self, batch):
            x, y = batch
            return F.mse_loss(self.model(x), y) * 50

        def on_step_start(self):
            for group in self.optimizers["optimizer"].param_groups:
                group["lr"] = get_lr(self.state.step)

        def on_before_optimizer_step(self, name, optimizer):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            super().on_before_optimizer_step(name, optimizer)

    model = net(width=16)
    trainer = port(NanoGPT, model=model, train_data=batches, optimizer=adamw(model), grad_accum=accum,
                   max_steps=max_iters)
    trainer.fit()
    assert trainer.lrs == lrs
    assert_same(hand, model)


@pytest.mark.parametrize("accum, clip", [(1, None), (3, 0.5), (2, 0.05)])
def test_float16_amp_with_unscaled_clipping_and_onecycle_per_update(accum, clip):
    """PyTorch's AMP examples (docs/source/notes/amp_examples.rst, "Gradient clipping" and "Gradient
    accumulation") as nanoGPT and llama-recipes write them: ``scaler.scale(loss / N).backward()``;
    ``scaler.unscale_(optimizer)`` then ``clip_grad_norm_``; ``scaler.step``, ``scaler.update``, then the
    scheduler (OneCycleLR, stepped on every update, also on those the scaler skips)."""
    ds, epochs = dataset(n=24), 2

    def onecycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)

    hand = net()
    opt, lrs = torch.optim.AdamW(hand.parameters(), lr=1e-2), []
    sched, scaler = onecycle(opt), torch.amp.GradScaler("cpu")
    loader = DataLoader(ds, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scaler's skipped first update makes torch warn about the order
        for _ in range(epochs):
            for i, (x, y) in enumerate(loader):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(hand(x), y)
                scaler.scale(loss / accum).backward()
                if (i + 1) % accum == 0 or i == len(loader) - 1:
                    if clip is not None:
                        scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(hand.parameters(), clip)
                    lrs.append(opt.param_groups[0]["lr"])
                    scaler.step(opt)
                    scaler.update()
                    sched.step()
                    opt.zero_grad(set_to_none=True)

        model = net()
        trainer = port(model=model, train_data=DataLoader(ds, batch_size=4),
                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), scheduler=onecycle, precision="16-mixed",
                       grad_accum=accum, max_epochs=epochs, **({} if clip is None else {"grad_clip": clip}))
        trainer.fit()
    assert trainer.lrs == lrs and trainer.scaler.get_scale() == scaler.get_scale()
    assert_same(hand, model)


def test_bf16_autocast_step_matches_the_hand_written_autocast_loop():
    """timm, train.py (``amp_autocast`` = ``torch.autocast(device_type, dtype=torch.bfloat16)``, no scaler for
    bfloat16): the forward and loss under autocast, backward and step outside it."""
    ds = dataset()
    hand = net()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1, momentum=0.9)
    for x, y in DataLoader(ds, batch_size=4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(hand(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    model = net()
    port(model=model, train_data=DataLoader(ds, batch_size=4), precision="bf16-mixed", max_epochs=1,
         optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)).fit()
    assert_same(hand, model)


def imagenet_loop(ds, val, epochs, fork_rng):
    """pytorch/examples imagenet/main.py's shape: ``model.train()``, the epoch, ``validate`` (``model.eval()``,
    ``no_grad``), then ``scheduler.step()`` (StepLR) every epoch; SGD with momentum and weight decay; a shuffled
    loader and batch norm."""
    hand = net(dropout=0.2, batch_norm=True)
    opt = torch.optim.SGD(hand.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched, lrs, val_losses = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), [], []
    torch.manual_seed(9)
    train_loader = DataLoader(ds, batch_size=4, shuffle=True)
    for _ in range(epochs):
        hand.train()
        for x, y in train_loader:
            loss = F.mse_loss(hand(x), y)
            opt.zero_grad()
            loss.backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
        with torch.random.fork_rng() if fork_rng else torch.enable_grad():
            hand.eval()
            with torch.no_grad():
                val_losses.append(sum(F.mse_loss(hand(x), y, reduction="sum") for x, y in
                                      DataLoader(val, batch_size=4)).item() / len(val))
        sched.step()
    return hand, lrs, val_losses


def test_steplr_per_epoch_and_validation_every_epoch_as_pytorch_examples_imagenet():
    """pytorch/examples, imagenet/main.py: StepLR stepped after each epoch's validation; batch-norm statistics
    untouched by validation. The port validates every epoch (``val_every`` = the steps of one pass) and steps
    StepLR with ``interval: epoch``. Its validation gives back the global generators (docs/trainer.md,
    "Validation leaves training's random streams as they were"), so it matches the loop whose ``validate`` runs
    under ``torch.random.fork_rng()``; the loop as written draws a seed per validation loader (see
    ``test_a_hand_loop_that_validates_draws_from_the_generator_the_port_gives_back``)."""
    ds, val, epochs = dataset(n=20), dataset(n=8, seed=2), 3
    hand, lrs, val_losses = imagenet_loop(ds, val, epochs, fork_rng=True)

    model = net(dropout=0.2, batch_norm=True)
    torch.manual_seed(9)
    trainer = port(model=model, train_data=DataLoader(ds, batch_size=4, shuffle=True), val_data=DataLoader(
        val, batch_size=4), val_every=5, max_epochs=epochs, optimizer=lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, weight_decay=1e-4), scheduler={"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(
            o, step_size=1, gamma=0.5), "interval": "epoch"})
    trainer.fit()
    assert trainer.lrs == lrs
    assert [m["val_loss"] for _, m in trainer.state.val_history[1:]] == pytest.approx(val_losses, rel=1e-6)
    assert_same(hand, model)  # running_mean, running_var and num_batches_tracked too


def test_a_hand_loop_that_validates_draws_from_the_generator_the_port_gives_back():
    """The same imagenet/main.py loop as written: each validation's DataLoader draws its base seed from the global
    generator, which moves the next epoch's shuffle and dropout masks. The port gives the generator back after each
    validation, so it trains as the loop without validation, not as this one. Documented as a promise (a run with
    ``val_data`` trains as without it), not as a difference from a hand-written loop."""
    ds, val, epochs = dataset(n=20), dataset(n=8, seed=2), 3
    hand, _, _ = imagenet_loop(ds, val, epochs, fork_rng=False)
    model = net(dropout=0.2, batch_norm=True)
    torch.manual_seed(9)
    port(model=model, train_data=DataLoader(ds, batch_size=4, shuffle=True), val_data=DataLoader(val, batch_size=4),
         val_every=5, max_epochs=epochs,
         optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
         scheduler={"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
                    "interval": "epoch"}).fit()
    with pytest.raises(AssertionError, match="differ"):
        assert_same(hand, model)


def plateau_loop(ds, val, epochs):
    """ReduceLROnPlateau stepped on the epoch's validation loss, as pytorch/examples' and most epoch loops do."""
    hand = net()
    opt = torch.optim.SGD(hand.parameters(), lr=0.5)
    sched, lrs = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0), []
    for _ in range(epochs):
        hand.train()
        for x, y in DataLoader(ds, batch_size=5):
            lrs.append(opt.param_groups[0]["lr"])
            F.mse_loss(hand(x), y).backward()
            opt.step()
            opt.zero_grad()
        hand.eval()
        with torch.no_grad():
            val_loss = sum(F.mse_loss(hand(x), y, reduction="sum") for x, y in DataLoader(val, batch_size=4)) / len(val)
        sched.step(val_loss)
    return hand, lrs


class Plateau(Regression):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


def test_reduce_on_plateau_on_each_epochs_validation_loss():
    """The epoch loop stepping ReduceLROnPlateau on its validation loss (pytorch/examples, and Lightning's
    ``{"scheduler": plateau, "monitor": "val_loss"}``): ported with ``val_every`` = one pass's steps, the
    learning rate halves at the same updates."""
    ds, val, epochs = dataset(n=20), dataset(n=8, seed=2), 6
    hand, lrs = plateau_loop(ds, val, epochs)
    model = net()
    trainer = port(Plateau, model=model, train_data=DataLoader(ds, batch_size=5),
                   val_data=DataLoader(val, batch_size=4),
                   val_every=4, max_epochs=epochs)
    trainer.fit()
    assert trainer.lrs == lrs and min(lrs) < 0.5  # it did reduce
    assert_same(hand, model)


def test_a_monitored_scheduler_that_no_validation_during_training_steps_is_refused():
    """Without ``val_every`` validation runs only at the end of ``fit``: a scheduler monitoring it would never step
    (Lightning validates every epoch by default, so this is the natural port)."""
    ds, val = dataset(n=20), dataset(n=8, seed=2)
    trainer = port(Plateau, model=net(), train_data=DataLoader(ds, batch_size=5),
                   val_data=DataLoader(val, batch_size=4), max_epochs=6)
    with pytest.raises(ConfigError, match=re.escape(
            "monitors 'val_loss', a validation metric, and no validation runs during training (val_every is not set: "
            "only at its end), so it would never step: set val_every=N, the steps between validations (Lightning "
            "validates every epoch)")):
        trainer.fit()
    assert trainer.state.step == 0


@pytest.mark.parametrize("zero_grad_first", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd-nesterov", "adamw"])
def test_zero_grad_before_backward_or_after_step_with_a_branch_used_every_other_step(zero_grad_first, optimizer):
    """pytorch/examples mnist/main.py (``optimizer.zero_grad()`` before the forward) and nanoGPT train.py
    (``zero_grad(set_to_none=True)`` after the step), with momentum and weight decay: an auxiliary head used on
    every other batch gets no gradient on the others (None), so the optimizer skips it there, decay included,
    in both loops and in the port."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body, self.head, self.aux = nn.Linear(6, 8), nn.Linear(8, 1), nn.Linear(8, 1)

        def forward(self, x, aux):
            h = torch.tanh(self.body(x))
            return self.head(h) + self.aux(h) if aux else self.head(h)

    def make(params):
        if optimizer == "adamw":
            return torch.optim.AdamW(params, lr=1e-2)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)

    ds = dataset(n=20)
    hand = Net()
    opt = make(hand.parameters())
    for i, (x, y) in enumerate(DataLoader(ds, batch_size=4)):
        if zero_grad_first:
            opt.zero_grad()
        F.mse_loss(hand(x, i % 2 == 0), y).backward()
        opt.step()
        if not zero_grad_first:
            opt.zero_grad(set_to_none=True)

    class Aux(Regression):
        def training_step(self, batch):
            x, y = batch
            return F.mse_loss(self.model(x, self.state.step % 2 == 0), y)

    model = Net()
    port(Aux, model=model, train_data=DataLoader(ds, batch_size=4), optimizer=make, max_epochs=1).fit()
    assert_same(hand, model)


def test_clipping_by_value_in_on_before_optimizer_step():
    """Clipping by value where the loop clips (e.g. the WGAN critic loops clip weights; gradient value clipping as
    in fairseq-like loops' ``clip_grad_value_`` before ``optimizer.step()``); ported into
    ``on_before_optimizer_step``, with accumulation."""
    ds = dataset()
    hand = net()
    opt = torch.optim.Adam(hand.parameters(), lr=1e-2)
    loader = DataLoader(ds, batch_size=2)
    for i, (x, y) in enumerate(loader):
        (F.mse_loss(hand(x), y) * 20 / 2).backward()
        if (i + 1) % 2 == 0 or i == len(loader) - 1:
            torch.nn.utils.clip_grad_value_(hand.parameters(), 0.1)
            opt.step()
            opt.zero_grad()

    class ByValue(Regression):
        def training_step(self, batch):
            return super().training_step(batch) * 20

        def on_before_optimizer_step(self, name, optimizer):
            torch.nn.utils.clip_grad_value_(self.model.parameters(), 0.1)

    model = net()
    port(ByValue, model=model, train_data=DataLoader(ds, batch_size=2), grad_accum=2, max_epochs=1,
         optimizer=lambda p: torch.optim.Adam(p, lr=1e-2)).fit()
    assert_same(hand, model)


def test_ema_updated_after_every_optimizer_update_with_accumulation():
    """timm, train.py: ``model_ema.update(model, step=num_updates)`` once per optimizer update (after the
    accumulation's last micro-batch), ported into ``on_step_end``."""
    ds, accum = dataset(), 3

    def ema_update(ema, model, decay=0.9):
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - decay)

    hand = net()
    hand_ema = net()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    loader = DataLoader(ds, batch_size=2)
    for i, (x, y) in enumerate(loader):
        (F.mse_loss(hand(x), y) / accum).backward()
        if (i + 1) % accum == 0 or i == len(loader) - 1:
            opt.step()
            opt.zero_grad()
            ema_update(hand_ema, hand)

    class WithEMA(Regression):
        def on_step_end(self, losses):
            ema_update(self.ema, self.model)

    model = net()
    trainer = port(WithEMA, model=model, train_data=DataLoader(ds, batch_size=2), grad_accum=accum, max_epochs=1,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer.ema = net()
    trainer.fit()
    assert_same(hand, model)
    assert_same(hand_ema, trainer.ema)


def test_grad_clip_with_decay_groups_matches_clipping_over_model_parameters():
    """torchvision references/classification/train.py (``set_weight_decay`` groups, then
    ``clip_grad_norm_(model.parameters(), args.clip_grad_norm)``), nanoGPT train.py (decay / no-decay groups,
    ``clip_grad_norm_(model.parameters(), grad_clip)``), transformers' no_decay groups with
    ``clip_grad_norm_(model.parameters(), max_grad_norm)``: the natural port is ``grad_clip=``."""
    ds = dataset(n=64)

    def wide():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    hand = wide()
    opt = torch.optim.AdamW(decay_groups(hand), lr=1e-2)
    for _ in range(3):
        for x, y in DataLoader(ds, batch_size=8):
            (F.mse_loss(hand(x), y) * 100).backward()
            torch.nn.utils.clip_grad_norm_(hand.parameters(), 0.3)
            opt.step()
            opt.zero_grad(set_to_none=True)

    class Scaled(Regression):
        def training_step(self, batch):
            return super().training_step(batch) * 100

    model = wide()
    port(Scaled, model=model, train_data=DataLoader(ds, batch_size=8), grad_clip=0.3, max_epochs=3,
         optimizer=torch.optim.AdamW(decay_groups(model), lr=1e-2)).fit()
    assert_same(hand, model)


def test_on_before_optimizer_step_sees_the_gradients_before_grad_clip_as_in_lightning():
    """Lightning's ``on_before_optimizer_step`` runs after unscaling and before ``gradient_clip_val``'s clipping
    (LightningModule.on_before_optimizer_step's docstring; ``configure_gradient_clipping`` runs after it). A hook
    that clips by value, next to ``gradient_clip_val``, trains as this loop: value clipping, then norm clipping."""
    ds = dataset()
    hand = net()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    for x, y in DataLoader(ds, batch_size=4):
        (F.mse_loss(hand(x), y) * 20).backward()
        torch.nn.utils.clip_grad_value_(hand.parameters(), 0.05)  # on_before_optimizer_step
        torch.nn.utils.clip_grad_norm_(hand.parameters(), 0.1)  # gradient_clip_val=0.1
        opt.step()
        opt.zero_grad()

    class Lightning(Regression):
        def training_step(self, batch):
            return super().training_step(batch) * 20

        def on_before_optimizer_step(self, name, optimizer):
            torch.nn.utils.clip_grad_value_(self.model.parameters(), 0.05)

    model = net()
    port(Lightning, model=model, train_data=DataLoader(ds, batch_size=4), grad_clip=0.1, max_epochs=1,
         optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).fit()
    assert_same(hand, model)


@pytest.mark.parametrize("check", ["auto", "off"])
def test_gradient_left_before_fit_is_not_added_to_the_first_update(check):
    """pytorch/examples mnist/main.py calls ``optimizer.zero_grad()`` before each backward, so gradient left by
    a backward before training (a sanity check, an lr-finder probe) never reaches an update. docs/trainer.md:
    "Between steps every gradient is None". The port either drops it or says where it came from."""
    ds = dataset(n=20)

    def probe(model):
        x, y = ds.tensors
        F.mse_loss(model(x[:4]), y[:4]).backward()

    hand = net()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    probe(hand)
    for x, y in DataLoader(ds, batch_size=5):
        opt.zero_grad()
        F.mse_loss(hand(x), y).backward()
        opt.step()

    model = net()
    probe(model)
    port(model=model, train_data=DataLoader(ds, batch_size=5), max_epochs=1, guard={"check": check},
         optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).fit()
    assert_same(hand, model)


class TwoHeads(nn.Module):
    """A detector's shape: a shared trunk, and the model returns its dict of named losses in training."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.box, self.cls = nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, x, y):
        h = self.trunk(x)
        return {"loss_box_reg": F.smooth_l1_loss(self.box(h), y), "loss_classifier": F.mse_loss(self.cls(h), y)}


def detection_loop(ds, epochs=3):
    """torchvision references/detection/engine.py, train_one_epoch: ``loss_dict = model(images, targets)``,
    ``losses = sum(loss for loss in loss_dict.values())``, one backward of the sum."""
    hand = TwoHeads()
    opt = torch.optim.Adam(hand.parameters(), lr=1e-2)
    for _ in range(epochs):
        for x, y in DataLoader(ds, batch_size=4):
            loss_dict = hand(x, y)
            losses = sum(loss for loss in loss_dict.values())
            opt.zero_grad()
            losses.backward()
            opt.step()
    return hand


class Detection(Regression):
    def training_step(self, batch):
        return self.model(*batch)


def test_a_dict_of_losses_summed_as_torchvision_detection_with_multi_loss_sum():
    """torchvision references/detection/engine.py sums the model's loss dict and back-propagates once; the port
    returns the dict (each loss logged by name) with ``multi_loss="sum"``."""
    ds = dataset(n=40)
    hand = detection_loop(ds)
    model = TwoHeads()
    port(Detection, model=model, train_data=DataLoader(ds, batch_size=4), multi_loss="sum", max_epochs=3,
         optimizer=lambda p: torch.optim.Adam(p, lr=1e-2)).fit()
    assert_same(hand, model)
