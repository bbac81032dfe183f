"""timm's training loop under native AMP: huggingface/pytorch-image-models, train.py at commit
2aabaef039d918d453b58714ab84562609981112 (``train_one_epoch``: ``amp_autocast``, ``loss /= accum_steps``,
``need_update``, ``loss_scaler(...)``, ``optimizer.zero_grad()`` after each update, ``lr_scheduler.step_update``)
and timm/utils/cuda.py at commit 522c9ea57df13e2acd8f6434451599a140105653 (``NativeScaler``: ``scale(loss).backward()``,
then on an update ``unscale_``, ``dispatch_clip_grad``, ``step`` and ``update``).

The forward and the loss under ``torch.autocast`` to float16; the loss divided by ``accum_steps`` outside it; the
GradScaler unscales before clipping the norm to ``--clip-grad 1.0``; the scheduler steps after every update, also
after an update the scaler skipped (PyTorch warns when the first one is: "Detected call of
``lr_scheduler.step()`` before ``optimizer.step()``").

Changes for a seconds-long test: a conv net of one conv and a linear head on 3x8x8 images, 3 classes;
8 batches of 4 a pass, 2 passes, ``--grad-accum-steps 2``; SGD with Nesterov momentum 0.9 (timm's ``sgd``),
``CrossEntropyLoss(label_smoothing=0.1)`` (``--smoothing 0.1``); the device is the CPU: ``NativeScaler('cpu')``
and ``torch.autocast('cpu', dtype=torch.float16)`` (timm's ``--amp-dtype float16``); timm's
``CosineLRScheduler.step_update`` replaced by torch's ``CosineAnnealingLR`` stepped after each update (the
Trainer refuses timm's scheduler, ``test_schedulers_real``); no prefetcher, mixup, EMA, meters, saver or
distributed code. The first batch and a later one are drawn 1000 times wider, so that the first update and a
later one overflow in float16 (in every pass): the scaler skips those updates, the scheduler still steps, the scale
halves each time.

The port: ``precision="16-mixed"``, ``grad_accum=2``, ``grad_clip=1.0`` (unscaled before clipping), the scheduler
through ``scheduler=`` (stepped after every update).
"""
import pytest
import torch
import torch.nn as nn

from safeloop import Trainer

from .harness import checks, compare_runs

EPOCHS, BATCHES, ACCUM, CLIP, LR = 2, 8, 2, 1.0, 0.05
WIDE = (0, 5)  # the batches drawn 1000 times wider


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device='cuda'):
        try:
            self._scaler = torch.amp.GradScaler(device=device)
        except (AttributeError, TypeError) as e:
            self._scaler = torch.cuda.amp.GradScaler()

    def __call__(
            self,
            loss,
            optimizer,
            clip_grad=None,
            clip_mode='norm',
            parameters=None,
            create_graph=False,
            need_update=True,
    ):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)  # dispatch_clip_grad(..., mode='norm')
            self._scaler.step(optimizer)
            self._scaler.update()


def make_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 3))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9, nesterov=True, weight_decay=2e-5)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS * BATCHES // ACCUM)


loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)


class Loader(list):
    def __init__(self):
        gen = torch.Generator().manual_seed(5)
        super().__init__((torch.randn(4, 3, 8, 8, generator=gen) * (1000 if i in WIDE else 1),
                          torch.randint(3, (4,), generator=gen)) for i in range(BATCHES))
        self.scales = []


def timm_hand(model, loader):
    optimizer = make_optimizer(model.parameters())
    lr_scheduler = make_scheduler(optimizer)
    loss_scaler = NativeScaler('cpu')
    amp_autocast = lambda: torch.autocast('cpu', dtype=torch.float16)  # noqa: E731 (partial(torch.autocast, ...))
    for epoch in range(EPOCHS):
        model.train()
        accum_steps = ACCUM
        last_accum_steps = len(loader) % accum_steps
        updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
        num_updates = epoch * updates_per_epoch
        last_batch_idx = len(loader) - 1
        last_batch_idx_to_accum = len(loader) - last_accum_steps
        optimizer.zero_grad()
        for batch_idx, (input, target) in enumerate(loader):
            last_batch = batch_idx == last_batch_idx
            need_update = last_batch or (batch_idx + 1) % accum_steps == 0
            if batch_idx >= last_batch_idx_to_accum:
                accum_steps = last_accum_steps

            def _forward():
                with amp_autocast():
                    output = model(input)
                    loss = loss_fn(output, target)
                if accum_steps > 1:
                    loss /= accum_steps
                return loss

            def _backward(_loss):
                loss_scaler(_loss, optimizer, clip_grad=CLIP, clip_mode='norm', parameters=model.parameters(),
                            need_update=need_update)

            loss = _forward()
            _backward(loss)
            if not need_update:
                continue
            num_updates += 1
            optimizer.zero_grad()
            loader.scales.append(loss_scaler._scaler.get_scale())
            lr_scheduler.step()  # lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)


class TimmPort(Trainer):
    def training_step(self, batch):
        input, target = batch
        output = self.model(input)
        return loss_fn(output, target)

    def on_step_end(self, losses):
        self.train_data.scales.append(self.scaler.get_scale())


@pytest.mark.parametrize("check", checks())
def test_timm_native_scaler_with_accumulation_clipping_and_a_scheduler_over_skipped_updates(check):
    runs = compare_runs(make_model, timm_hand, TimmPort, Loader, check, steps=EPOCHS * BATCHES // ACCUM,
                        precision="16-mixed", grad_accum=ACCUM, grad_clip=CLIP, optimizer=make_optimizer,
                        scheduler=make_scheduler)
    hand, watched, port = (run.scales for run in runs)
    assert watched == hand and port == hand
    # the updates over batches 0 and 5, in each pass, were skipped: the scale halved four times
    assert hand == [2.0 ** 15, 2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 2.0 ** 13, 2.0 ** 13, 2.0 ** 12, 2.0 ** 12], hand


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
@pytest.mark.parametrize("stop", [3, 5], ids=["after_a_skipped_update", "in_the_second_pass"])
def test_timm_native_scaler_resumed_midway(tmp_path, stop):
    from .harness import assert_same
    from .test_resume_ports import straight_and_resumed
    straight, resumed = straight_and_resumed(tmp_path, make_model, TimmPort, lambda model: Loader(),
                                             EPOCHS * BATCHES // ACCUM, stop, precision="16-mixed", grad_accum=ACCUM,
                                             grad_clip=CLIP, optimizer=make_optimizer, scheduler=make_scheduler)
    assert_same(resumed.model, straight.model)
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    assert resumed.train_data.scales == straight.train_data.scales[stop:]
    assert resumed.schedulers["optimizer"].state_dict() == straight.schedulers["optimizer"].state_dict()
