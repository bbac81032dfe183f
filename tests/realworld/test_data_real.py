"""The training data as real code feeds it, compared with the hand-written loop bit for bit.

Each case ports a public loop's way of feeding data: a streaming ``IterableDataset`` without ``__len__`` that
reshuffles from ``set_epoch`` (webdataset, Hugging Face ``datasets`` streaming, timm's ``train.py``), a
``DistributedSampler(num_replicas=1, rank=0)`` in one process (pytorch/examples' ``imagenet/main.py``), a pass
whose length is not divisible by ``grad_accum``, with ``drop_last`` too (the ``(i + 1) % N == 0 or
i == len(loader) - 1`` loop of accelerate's examples and Lightning's accumulation), Lightning's
``GradientAccumulationScheduler``, a curriculum sampler whose pass grows each epoch, ``max_epochs`` with
``max_steps``, one-shot generators as ``train_data`` and ``val_data``, a validated stream drawing from the global
generators, Lightning's dict of training loaders, a shuffled loader resumed mid-pass, denoising-diffusion-pytorch's
endless ``cycle(loader)`` resumed, a generator reseeded each epoch (``g.manual_seed(seed + epoch)``), Lightning's
``reload_dataloaders_every_n_epochs`` and ``on_after_batch_transfer`` ported as the documentation says, and
batches as dicts, namedtuples, dataclasses, Hugging Face's ``BatchEncoding``, strings, ints and NumPy arrays.
Parameters, the batches ``training_step`` sees, the samples read, the step and epoch counts and ``trainer.state``
in the hooks are compared with the hand loop, Lightning's behaviour, or what docs/trainer.md and docs/checkpoints.md
promise.
"""
from __future__ import annotations

import collections
import dataclasses
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

from safeloop import ConfigError, Trainer

QUIET = dict(device="cpu", progress=False, loggers=())
N = 20  # samples: 5 batches of 4


def xy(n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=gen), torch.randn(n, 1, generator=gen)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def dropout_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Linear(8, 1))


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Counted(Dataset):
    """A map-style dataset that counts the samples read (``reads``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y, self.reads = x, y, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i], self.y[i]


class Stream(IterableDataset):
    """A stream without ``__len__`` that reshuffles from its epoch, as webdataset's and ``datasets``' streaming
    ``IterableDataset.set_epoch`` do (metaseq's ``StreamingShuffleDataset``). timm's ``train.py`` calls
    ``dataset_train.set_epoch(epoch)`` before each pass; neither Lightning nor safeloop calls a dataset's, so the
    port calls it in ``on_epoch_start``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y, self.epoch, self.reads, self.epochs_set = x, y, 0, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __iter__(self):
        for i in torch.randperm(len(self.x), generator=torch.Generator().manual_seed(100 + self.epoch)).tolist():
            self.reads += 1
            yield self.x[i], self.y[i]


def hand_accumulated(loader: DataLoader, accum: int, epochs: int) -> tuple[nn.Module, int]:
    """The accumulation loop of accelerate's examples and Lightning's ``accumulate_grad_batches``: each loss divided
    by ``accum``, an update every ``accum`` batches and at the pass's last batch (5 batches a pass known ahead, as
    ``len(loader)``), ``set_epoch`` on a dataset that has one before each pass (timm's ``train.py``). Returns the
    model and its updates."""
    net, updates = mlp(), 0
    opt = sgd(net.parameters())
    for epoch in range(epochs):
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            (F.mse_loss(net(x), y) / accum).backward()
            if (i + 1) % accum == 0 or i == 5 - 1:
                opt.step()
                opt.zero_grad()
                updates += 1
    return net, updates


class Recorded(Trainer):
    """Writes down the epoch hooks and each step's start with the ``trainer.state`` values they see, and calls
    ``set_epoch`` on a dataset that has one (what webdataset's and ``datasets``' examples do before each pass)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events, self.micro = [], []

    def on_epoch_start(self):
        self.events.append(("epoch_start", self.state.epoch, self.state.step))
        dataset = getattr(self.train_data, "dataset", None)
        if callable(getattr(dataset, "set_epoch", None)):
            dataset.set_epoch(self.state.epoch)

    def on_step_start(self):
        self.events.append(("step_start", self.state.step, self.state.batch_in_epoch))

    def training_step(self, batch):
        self.micro.append((self.state.epoch, self.state.batch_in_epoch))
        return super().training_step(batch)

    def on_epoch_end(self):
        self.events.append(("epoch_end", self.state.epoch, self.state.step, self.state.batch_in_epoch))


class Seen(Trainer):
    """Keeps the first tensor of each batch ``training_step`` gets (``seen``)."""

    def training_step(self, batch):
        self.seen.append(batch[0])
        return super().training_step(batch)


# -- passes: streams, accumulation, epochs ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["map-style", "map-style, drop_last", "stream"])
@pytest.mark.parametrize("accum", [1, 3])
def test_two_passes_with_accumulation_match_the_hand_loop(kind, accum):
    """accelerate's ``examples/by_feature/gradient_accumulation.py`` and Lightning's ``accumulate_grad_batches``
    over 5 batches a pass (not divisible by 3: the last update takes 2) for ``max_epochs=2``; the data a
    map-style dataset (22 samples with ``drop_last=True``: the 2 left over never read), or a webdataset-like stream
    without ``__len__`` that reshuffles from ``set_epoch``. The
    parameters, the updates, the samples read (none ahead), and the hooks' ``trainer.state``
    (docs/trainer.md, Hooks: ``batch_in_epoch`` in ``on_step_start`` includes the step's own batches; in
    ``training_step``, those up to its micro-batch, Lightning's ``batch_idx + 1``)."""
    drop_last = kind.endswith("drop_last")
    x, y = xy(22 if drop_last else N)
    make = Stream if kind == "stream" else Counted
    reference, updates = hand_accumulated(DataLoader(make(x, y), batch_size=4, drop_last=drop_last), accum, 2)
    data = make(x, y)
    t = Recorded(model=mlp(), train_data=DataLoader(data, batch_size=4, drop_last=drop_last), optimizer=sgd,
                 max_epochs=2, grad_accum=accum, **QUIET)
    state = t.fit()
    assert same(t.model, reference)
    assert (state.step, state.epoch, data.reads) == (updates, 2, 2 * N)
    per_pass = [min(5, j + accum) for j in range(0, 5, accum)]  # batch_in_epoch at each step's start
    first = updates // 2
    expected = [("epoch_start", 0, 0)] + [("step_start", i, b) for i, b in enumerate(per_pass)]
    expected += [("epoch_end", 0, first, 5), ("epoch_start", 1, first)]
    expected += [("step_start", first + i, b) for i, b in enumerate(per_pass)] + [("epoch_end", 1, updates, 5)]
    assert t.events == expected
    assert t.micro == [(epoch, b) for epoch in range(2) for b in range(1, 6)]  # Lightning's batch_idx + 1
    if kind == "stream":
        assert data.epochs_set == [0, 1]


def test_gradient_accumulation_scheduler_port_matches_the_hand_loop():
    """Lightning's ``GradientAccumulationScheduler(scheduling={0: 1, 1: 2, 2: 3})`` ported as docs/trainer.md says
    (``self.grad_accum`` set in ``on_epoch_start``), with an epoch ``StepLR``; the hand loop changes its ``accum`` at
    each epoch and steps the scheduler after each pass. 7 batches a pass: none divisible by 2 or 3."""
    scheduling = {0: 1, 1: 2, 2: 3}
    x, y = xy(28)
    net = mlp()
    opt = sgd(net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    loader, updates = DataLoader(TensorDataset(x, y), batch_size=4), 0
    for epoch in range(3):
        k = scheduling[epoch]
        for i, (bx, by) in enumerate(loader):
            (F.mse_loss(net(bx), by) / k).backward()
            if (i + 1) % k == 0 or i == len(loader) - 1:
                opt.step()
                opt.zero_grad()
                updates += 1
        sched.step()

    class Scheduled(Trainer):
        def on_epoch_start(self):
            self.grad_accum = scheduling[self.state.epoch]

    t = Scheduled(model=mlp(), train_data=DataLoader(TensorDataset(x, y), batch_size=4), optimizer=sgd,
                  scheduler={"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5), "interval": "epoch"},
                  max_epochs=3, **QUIET)
    assert t.fit().step == updates == 7 + 4 + 3
    assert same(t.model, net)
    rate, = [o.param_groups[0]["lr"] for o in t.optimizers.values()]
    assert rate == opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3


def test_distributed_sampler_in_one_process_gets_each_epoch_as_imagenet_main_gives_it():
    """pytorch/examples ``imagenet/main.py``: ``train_sampler.set_epoch(epoch)`` before each pass over a loader with
    ``sampler=DistributedSampler(...)``; here ``num_replicas=1, rank=0`` in one process (a script kept runnable
    without torchrun). Each epoch's order, the parameters, and a new order each epoch."""
    x, y = xy()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
    net = mlp()
    opt, orders = sgd(net.parameters()), []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for bx, by in DataLoader(dataset, batch_size=4, sampler=sampler):
            orders.append(bx)
            opt.zero_grad()
            F.mse_loss(net(bx), by).backward()
            opt.step()

    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=5))
    t = Seen(model=mlp(), train_data=loader, optimizer=sgd, max_epochs=3, **QUIET)
    t.seen = []
    t.fit()
    assert len(t.seen) == len(orders) == 15 and all(torch.equal(a, b) for a, b in zip(t.seen, orders))
    assert not torch.equal(torch.cat(orders[:5]), torch.cat(orders[5:10]))
    assert same(t.model, net)


class Curriculum(torch.utils.data.Sampler):
    """A curriculum sampler whose pass grows with the epoch ``set_epoch`` gives it (8, 12, 16 samples: easy to hard,
    as the bucketing and curriculum samplers of speech and translation code do), shuffled by the epoch."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return 8 + 4 * self.epoch

    def __iter__(self):
        return iter(torch.randperm(len(self), generator=torch.Generator().manual_seed(self.epoch)).tolist())


def test_a_loader_whose_length_grows_each_epoch_ends_each_pass_where_the_hand_loop_does():
    """A loader whose length changes between epochs (the curriculum sampler above: 2, 3 and 4 batches), trained in
    three fits that each end at a pass's last batch (``max_steps`` 2, 5, then ``max_epochs=3``): each pass ends with
    its fit (docs/trainer.md, Hooks: the length is known), and the parameters equal the hand loop's that calls
    ``sampler.set_epoch(epoch)`` before each pass."""
    dataset = TensorDataset(*xy(16))
    sampler = Curriculum()
    net = mlp()
    opt = sgd(net.parameters())
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for bx, by in DataLoader(dataset, batch_size=4, sampler=sampler):
            opt.zero_grad()
            F.mse_loss(net(bx), by).backward()
            opt.step()
    t = Recorded(model=mlp(), train_data=DataLoader(dataset, batch_size=4, sampler=Curriculum()), optimizer=sgd,
                 max_steps=2, **QUIET)
    t.fit()
    t.max_steps = 5
    t.fit()
    t.max_steps, t.max_epochs = 100, 3
    assert t.fit().step == 9
    ends = [event for event in t.events if event[0] != "step_start"]
    assert ends == [("epoch_start", 0, 0), ("epoch_end", 0, 2, 2), ("epoch_start", 1, 2), ("epoch_end", 1, 5, 3),
                    ("epoch_start", 2, 5), ("epoch_end", 2, 9, 4)]
    assert same(t.model, net)


class Again:
    """An iterable of a list's batches without a length (``__iter__`` returns a new iterator each time)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("kind", ["list", "iterable without a length"])
def test_max_steps_at_a_pass_end_then_more_fits_keep_the_epoch_hooks_of_the_run_that_never_stopped(kind):
    """docs/trainer.md, Hooks: where ``max_steps`` ends a run right after a pass's last batch, the pass ends with
    the run when the data's length is known (a list), otherwise when training goes on; a run ended mid-pass calls
    no ``on_epoch_end`` and the next ``fit()`` goes on in that pass without ``on_epoch_start``; ``max_epochs``
    together with ``max_steps`` ends at whichever comes first."""
    x, y = xy(16)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)]
    t = Recorded(model=mlp(), train_data=batches if kind == "list" else Again(batches), optimizer=sgd,
                 max_steps=4, **QUIET)
    t.fit()
    first = list(t.events)
    t.max_steps = 6
    t.fit()
    second = t.events[len(first):]
    t.max_steps, t.max_epochs = 100, 2
    state = t.fit()
    third = t.events[len(first) + len(second):]
    steps = [("step_start", i, i + 1) for i in range(4)]
    if kind == "list":
        assert first == [("epoch_start", 0, 0)] + steps + [("epoch_end", 0, 4, 4)]
        assert second[0] == ("epoch_start", 1, 4)
    else:
        assert first == [("epoch_start", 0, 0)] + steps
        assert second[:2] == [("epoch_end", 0, 4, 4), ("epoch_start", 1, 4)]
    assert second[-2:] == [("step_start", 4, 1), ("step_start", 5, 2)]
    assert third == [("step_start", 6, 3), ("step_start", 7, 4), ("epoch_end", 1, 8, 4)]
    assert (state.step, state.epoch) == (8, 2)


def test_a_one_shot_generator_trains_one_pass_and_a_second_is_refused_with_what_to_pass():
    """A plain Python generator as ``train_data`` (``(batch for batch in ...)``, as quick scripts write it): one
    epoch trains as the hand loop over it; a second epoch is the ``ConfigError`` docs/trainer.md (Mistakes that would
    otherwise be silent) promises, not an epoch of nothing."""
    x, y = xy(16)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)]
    net = mlp()
    opt = sgd(net.parameters())
    for bx, by in batches:
        opt.zero_grad()
        F.mse_loss(net(bx), by).backward()
        opt.step()
    t = Trainer(model=mlp(), train_data=(b for b in batches), optimizer=sgd, max_epochs=1, **QUIET)
    assert (t.fit().step, t.state.epoch) == (4, 1)
    assert same(t.model, net)
    t = Trainer(model=mlp(), train_data=(b for b in batches), optimizer=sgd, max_epochs=2, **QUIET)
    with pytest.raises(ConfigError, match=r"train_data is a generator, an iterator that one pass uses up: epoch 2 "
                                          r"got no batches"):
        t.fit()
    assert t.state.step == 4


class Augmented(IterableDataset):
    """A stream shuffled with Python's ``random`` (webdataset's shuffle buffer) whose samples are augmented in the
    main process from torch's and NumPy's global generators."""

    def __init__(self, n: int):
        self.x, self.y = xy(n)

    def __iter__(self):
        order = list(range(len(self.x)))
        random.shuffle(order)
        for i in order:
            yield self.x[i] + 0.1 * torch.randn(3) + float(np.random.rand()), self.y[i]


def test_validating_a_stream_leaves_the_training_stream_as_it_was():
    """docs/trainer.md (Validation): a run with ``val_data`` trains exactly as the same run without it. Both
    streams draw from the global ``random``, NumPy and torch generators as they are read; dropout draws too;
    validation every 2 steps of ``grad_accum=2`` over three passes."""

    def run(validated: bool) -> nn.Module:
        torch.manual_seed(1)
        random.seed(1)
        np.random.seed(1)
        t = Trainer(model=dropout_mlp(), train_data=DataLoader(Augmented(N), batch_size=4),
                    val_data=DataLoader(Augmented(8), batch_size=4) if validated else None,
                    val_every=2 if validated else None, optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
                    max_epochs=3, grad_accum=2, **QUIET)
        t.fit()
        assert len(t.state.val_history) == (6 if validated else 0)
        return t.model

    assert same(run(True), run(False))


def test_a_dict_of_loaders_as_lightning_combines_them_is_refused_before_training():
    """Lightning's multiple training iterables (lightning.ai docs, data/iterables: ``return {"a": DataLoader(...),
    "b": DataLoader(...)}`` from ``train_dataloader``, batches ``{"a": ..., "b": ...}``) given as ``train_data``:
    iterated, a dict gives its keys, so it is refused when the Trainer is made, as a list of loaders is."""
    a = DataLoader(TensorDataset(*xy(8)), batch_size=4)
    b = DataLoader(TensorDataset(*xy(8, seed=1)), batch_size=4)
    with pytest.raises(ConfigError, match=r"train_data is a list of 2 DataLoaders"):
        Trainer(model=mlp(), train_data=[a, b], optimizer=sgd, max_steps=2, **QUIET)
    with pytest.raises(ConfigError, match=r"train_data=.* is a dict"):
        Trainer(model=mlp(), train_data={"a": a, "b": b}, optimizer=sgd, max_steps=2, **QUIET)


def test_a_one_shot_generator_as_val_data_is_named_when_the_second_validation_finds_it_used_up():
    """Quick scripts pass ``val_data=(batch for batch in ...)`` as they pass ``train_data``. docs/trainer.md
    (Mistakes that would otherwise be silent) says a one-shot ``train_data`` stops with an error that says the
    generator is used up and what to pass instead; the same generator as ``val_data`` serves the validation before
    training and is empty at the next one."""
    x, y = xy(16)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)]
    t = Trainer(model=mlp(), train_data=batches, val_data=(b for b in batches[:2]), val_every=2, optimizer=sgd,
                max_steps=4, **QUIET)
    with pytest.raises(ConfigError, match=r"val_data is a generator.*(uses? up|used up)"):
        t.fit()
    assert len(t.state.val_history) == 1


# -- resume mid-pass ------------------------------------------------------------------------------------------------
def shuffled(kind: str) -> DataLoader:
    dataset = TensorDataset(*xy())
    if kind == "generator":
        return DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    return DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=5))


@pytest.mark.parametrize("kind", ["generator", "distributed sampler"])
def test_resume_mid_pass_of_a_shuffled_loader_trains_as_the_run_that_never_stopped(kind, tmp_path):
    """lightning-hydra-template's ``ckpt_path`` resume, here ``resume="auto"``: a loader shuffled by its own
    ``torch.Generator`` (or a ``DistributedSampler`` with its seed), dropout drawing from torch's generator,
    ``grad_accum=2``; stopped mid-pass at step 7 of 9, resumed in a new process state (torch reseeded, a new
    model). The parameters equal the run that never stopped (docs/checkpoints.md, Resume)."""
    torch.manual_seed(1)
    never = Trainer(model=dropout_mlp(), train_data=shuffled(kind), optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
                    max_epochs=3, grad_accum=2, **QUIET)
    never.fit()
    torch.manual_seed(1)
    first = Trainer(model=dropout_mlp(), train_data=shuffled(kind), optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
                    max_epochs=3, max_steps=7, grad_accum=2, checkpoint={"dir": str(tmp_path), "every": 100}, **QUIET)
    first.fit()
    assert (first.state.epoch, first.state.batch_in_epoch) == (2, 2)
    torch.manual_seed(123)
    resumed = Trainer(model=dropout_mlp(9), train_data=shuffled(kind),
                      optimizer=lambda p: torch.optim.Adam(p, lr=0.01), max_epochs=3, grad_accum=2,
                      checkpoint={"dir": str(tmp_path)}, resume="auto", **QUIET)
    assert resumed.fit().step == 9
    assert same(resumed.model, never.model)


def cycle(loader):
    """denoising-diffusion-pytorch's ``cycle`` (lucidrains, ``denoising_diffusion_pytorch.py``: ``self.dl =
    cycle(dl)``, then ``next(self.dl)`` each step): the loader's passes, endlessly."""
    while True:
        for batch in loader:
            yield batch


def cycled(seed: int, generator: bool, **settings) -> Seen:
    own = dict(generator=torch.Generator().manual_seed(5)) if generator else {}
    t = Seen(model=dropout_mlp(seed), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
             train_data=cycle(DataLoader(TensorDataset(*xy(12)), batch_size=4, shuffle=True, **own)), **settings,
             **QUIET)
    t.seen = []
    return t


@pytest.mark.parametrize("generator", [True, False], ids=["own generator", "torch's generator"])
def test_resume_inside_an_endless_cycle_of_a_shuffled_loader(tmp_path, generator):
    """denoising-diffusion-pytorch's trainer feeds ``cycle(DataLoader(..., shuffle=True))`` for ``train_num_steps``;
    ported as ``train_data=cycle(loader)`` with ``max_steps``, with dropout. Stopped after step 4 (one batch into
    the loader's second pass), resumed in a new process state. The whole run is one pass of ``train_data``, re-drawn
    on resume from the RNG states it began with: with a generator of the loader's own, the batches after the resume
    and the parameters equal the run that never stopped. Shuffled from torch's generator, which dropout moved in
    between, the loader's second order differs (docs/checkpoints.md, the limits of bit-identical resumes)."""
    torch.manual_seed(1)
    never = cycled(0, generator, max_steps=8)
    never.fit()
    torch.manual_seed(1)
    first = cycled(0, generator, max_steps=4, checkpoint={"dir": str(tmp_path), "every": 100})
    first.fit()
    assert all(torch.equal(a, b) for a, b in zip(first.seen, never.seen[:4]))
    torch.manual_seed(77)
    resumed = cycled(3, generator, max_steps=8, checkpoint={"dir": str(tmp_path)}, resume="auto")
    assert resumed.fit().step == 8
    same_batches = [torch.equal(a, b) for a, b in zip(resumed.seen, never.seen[4:])]
    assert same_batches == [True] * 4 if generator else same_batches != [True] * 4
    assert same(resumed.model, never.model) == generator


# -- a generator reseeded, a loader made anew, each epoch ------------------------------------------------------------
def hand_epochs(loader_for_epoch, epochs: int = 3) -> tuple[nn.Module, list]:
    net, seen = mlp(), []
    opt = sgd(net.parameters())
    for epoch in range(epochs):
        for bx, by in loader_for_epoch(epoch):
            seen.append(bx)
            opt.zero_grad()
            F.mse_loss(net(bx), by).backward()
            opt.step()
    return net, seen


def test_a_generator_reseeded_each_epoch_shuffles_as_the_hand_loop():
    """A loop that makes each epoch's order reproducible on its own (``g.manual_seed(seed + epoch)`` before the pass,
    as the epoch-seeded samplers of fairseq and accelerate's ``SeedableRandomSampler`` do): the port reseeds the
    loader's generator in ``on_epoch_start``. Each batch seen and the parameters, 3 epochs."""
    dataset = TensorDataset(*xy(12))
    g = torch.Generator()
    loader = DataLoader(dataset, batch_size=4, shuffle=True, generator=g)

    def reseeded(epoch):
        g.manual_seed(100 + epoch)
        return loader

    net, orders = hand_epochs(reseeded)
    g2 = torch.Generator()

    class Reseeded(Seen):
        def on_epoch_start(self):
            g2.manual_seed(100 + self.state.epoch)

    t = Reseeded(model=mlp(), train_data=DataLoader(dataset, batch_size=4, shuffle=True, generator=g2), optimizer=sgd,
                 max_epochs=3, **QUIET)
    t.seen = []
    t.fit()
    assert len(t.seen) == len(orders) == 9
    assert [torch.equal(a, b) for a, b in zip(t.seen, orders)] == [True] * 9
    assert same(t.model, net)


def test_a_new_loader_each_epoch_as_reload_dataloaders_every_n_epochs_trains_as_the_hand_loop():
    """Lightning's ``reload_dataloaders_every_n_epochs=1`` with a ``train_dataloader()`` that builds a seeded loader
    (``generator=torch.Generator().manual_seed(seed)``, a curriculum's subset growing each epoch), ported as
    docs/trainer.md (Coming from Lightning) says: ``self.train_data = ...`` in ``on_epoch_start``. The hand loop
    iterates each epoch's new loader."""
    x, y = xy(16)

    def loader_for(epoch):  # the first 8, 12, 16 samples: easy to hard
        n = 8 + 4 * epoch
        return DataLoader(TensorDataset(x[:n], y[:n]), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(42))

    net, orders = hand_epochs(loader_for)

    class Reloaded(Seen):
        def on_epoch_start(self):
            self.train_data = loader_for(self.state.epoch)

    t = Reloaded(model=mlp(), train_data=loader_for(0), optimizer=sgd, max_epochs=3, **QUIET)
    t.seen = []
    state = t.fit()
    assert state.step == len(orders) == 2 + 3 + 4
    assert [torch.equal(a, b) for a, b in zip(t.seen, orders)] == [True] * 9
    assert same(t.model, net)


# -- what a batch is --------------------------------------------------------------------------------------------------
class Encoding(collections.UserDict):
    """Hugging Face's ``BatchEncoding`` as a loop meets it (transformers ``tokenization_utils_base.py``): a
    ``UserDict`` whose keys read as attributes, holding the fast tokenizer's encodings (``word_ids()``, which raises
    this ValueError without them) and moved by its own ``to(device)``, which keeps them."""

    def __init__(self, data=None, encoding=None):
        super().__init__(data)
        self._encodings = encoding

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    def word_ids(self, batch_index: int = 0):
        if not self._encodings:
            raise ValueError("word_ids() is not available when using non-fast tokenizers (e.g. instance of a "
                             "`XxxTokenizerFast` class).")
        return self._encodings[batch_index]

    def to(self, device):
        self.data = {k: v.to(device=device) if isinstance(v, torch.Tensor) else v for k, v in self.data.items()}
        return self


@dataclasses.dataclass
class Batch:
    """A dataclass batch (torchtune's and many repositories' ``Batch``)."""
    x: torch.Tensor
    y: torch.Tensor
    ids: list


Pair = collections.namedtuple("Pair", "x y")


def kinds_of_batches() -> dict:
    x, y = xy(4)
    text = {"x": x, "y": y, "n": 4, "text": ["a cat", "a dog", "", "ok"], "weights": np.arange(4.0),
            "tokens": [torch.arange(3), torch.arange(5)], "index": torch.arange(4)}
    return {"dict of text, ints, arrays": text, "namedtuple": Pair(x, y), "UserDict": Encoding({"x": x, "y": y}),
            "dataclass": Batch(x, y, [7, 8])}


def x_and_y(batch):
    return (batch["x"], batch["y"]) if isinstance(batch, collections.abc.Mapping) else (batch.x, batch.y)


class Typed(Trainer):
    def training_step(self, batch):
        self.given.append(batch)
        x, y = x_and_y(batch)
        return F.mse_loss(self.model(x).float(), y.float())


@pytest.mark.parametrize("precision", ["32", "bf16-true"])
def test_batches_reach_training_step_with_their_types(precision):
    """Batches as Hugging Face's collators, torchtext-style text and ``namedtuple`` / dataclass collates make them:
    on the CPU in float32 ``training_step`` gets the very object; under ``bf16-true`` (``to_device`` casts the floating
    tensors, docs/trainer.md Precision) the same types, floating tensors in bfloat16, integer tensors, ints,
    strings, NumPy arrays and lists of variable-length tensors as they were."""
    batches = kinds_of_batches()
    net = nn.Linear(3, 1)
    t = Typed(model=net, train_data=list(batches.values()), optimizer=sgd, max_steps=4, precision=precision, **QUIET)
    t.given = []
    t.fit()
    for given, (name, batch) in zip(t.given, batches.items()):
        assert type(given) is type(batch), name
        if precision == "32":
            assert given is batch, name
        else:
            assert x_and_y(given)[0].dtype == torch.bfloat16, name
            assert torch.equal(x_and_y(given)[0], x_and_y(batch)[0].to(torch.bfloat16)), name
    mixed, original = t.given[0], batches["dict of text, ints, arrays"]
    assert mixed["text"] == original["text"] and mixed["n"] == 4
    assert type(mixed["weights"]) is np.ndarray and np.array_equal(mixed["weights"], original["weights"])
    assert mixed["index"].dtype == torch.int64 and [t.tolist() for t in mixed["tokens"]] == [[0, 1, 2], list(range(5))]
    assert t.given[3].ids == [7, 8]


class Normalizing(Trainer):
    """Lightning's ``on_after_batch_transfer`` (its documented use: a transform of ``batch["x"]`` once the batch is on
    the device, Kornia's augmentations or a normalization), ported as safeloop's error for that name says: an
    override of ``to_device(batch)``."""

    def to_device(self, batch):
        self.moved += 1
        x, y = super().to_device(batch)
        return (x - 1.0) / 2.0, y


def test_an_on_after_batch_transfer_port_runs_for_every_training_batch():
    """The port named by the ``ConfigError`` that Lightning's ``on_after_batch_transfer`` gets (lightning.ai docs,
    LightningModule hooks): ``to_device`` overridden to normalize ``x``. Lightning calls the hook for each batch on
    every device, the CPU too; here 4 training batches and two validations of one batch, and the parameters equal
    the hand loop that normalizes each batch."""

    class Ported(Trainer):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch

    batches = [(x[i:i + 4], y[i:i + 4]) for x, y in [xy(16)] for i in range(0, 16, 4)]
    with pytest.raises(ConfigError, match=r"on_after_batch_transfer.*override to_device\(batch\)"):
        Ported(model=mlp(), train_data=batches, optimizer=sgd, max_steps=4, **QUIET).fit()
    net = mlp()
    opt = sgd(net.parameters())
    for bx, by in batches:
        opt.zero_grad()
        F.mse_loss(net((bx - 1.0) / 2.0), by).backward()
        opt.step()
    t = Normalizing(model=mlp(), train_data=batches, val_data=batches[:1], optimizer=sgd, max_steps=4, **QUIET)
    t.moved = 0
    t.fit()
    assert t.moved == 4 + 2
    assert same(t.model, net)


class WordAligned(Trainer):
    """Token classification's evaluation (transformers ``examples/pytorch/token-classification``): predictions are
    aligned to words with the batch's ``word_ids``."""

    def training_step(self, batch):
        self.words.append(batch.word_ids(0))
        return F.mse_loss(self.model(batch["x"]), batch["y"])


def test_a_batch_encoding_keeps_its_word_ids_through_validation():
    """A Hugging Face ``BatchEncoding`` batch (above) in ``train_data`` and ``val_data`` on the CPU: ``training_step``
    (the default ``validation_step`` too) reads ``batch.word_ids(0)``. Lightning moves such a batch with its own
    ``to`` (any object with a ``to`` method), as accelerate does, so its encodings stay."""
    x, y = xy(4)
    t = WordAligned(model=nn.Linear(3, 1), train_data=[Encoding({"x": x, "y": y}, encoding=[[None, 0, 0, 1]])],
                    val_data=[Encoding({"x": x, "y": y}, encoding=[[None, 0, 1, 1]])], optimizer=sgd, max_steps=1,
                    **QUIET)
    t.words = []
    t.fit()
    assert t.words == [[None, 0, 1, 1], [None, 0, 0, 1], [None, 0, 1, 1]]  # validation, the step, validation
