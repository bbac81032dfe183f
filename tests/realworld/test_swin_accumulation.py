"""Swin Transformer's training loop with gradient accumulation: microsoft/Swin-Transformer at commit 00f2800,
main.py (``main``: the scheduler built on ``len(data_loader_train) // ACCUMULATION_STEPS`` updates an epoch,
``train_one_epoch``, ``validate``), utils.py (``NativeScalerWithGradNormCount``, ``ampscaler_get_grad_norm``),
lr_scheduler.py (``build_scheduler`` for ``cosine``: timm's ``CosineLRScheduler`` on updates, shared with
test_schedulers_real) and optimizer.py (``build_optimizer`` for ``adamw``, ``set_weight_decay``).

- ``optimizer.zero_grad()`` at each epoch's start; each loss divided by ``ACCUMULATION_STEPS``; the scaler's
  ``update_grad=(idx + 1) % ACCUMULATION_STEPS == 0``: clip by norm (``CLIP_GRAD`` 5.0) and step only then, then
  ``zero_grad`` and ``lr_scheduler.step_update((epoch * num_steps + idx) // ACCUMULATION_STEPS)``: the index of
  the update just made counted in micro-batches over whole epochs. With an epoch whose length is no multiple of
  ``ACCUMULATION_STEPS`` its last micro-batches are back-propagated, never stepped, and dropped by the next
  epoch's ``zero_grad``, and the update index skips a number at each epoch.
- AdamW in two groups (no decay on 1-d parameters, biases, ``no_weight_decay()`` and names holding
  ``no_weight_decay_keywords()``), the rates scaled linearly by the batch size and by ``ACCUMULATION_STEPS``;
  label smoothing; ``validate`` after each epoch.

Changes for a seconds-long test: a token MLP with an ``absolute_pos_embed``, LayerNorm and a
``relative_position_bias_table`` stand-in for the Swin model; 3 epochs of 4 (or 5) batches of 4,
``ACCUMULATION_STEPS`` 2, warm-up 1 epoch; AMP off (``--disable_amp``: the scaler's ``GradScaler`` made disabled,
``torch.cuda.amp.autocast(enabled=False)`` left out), no Mixup, no distributed run (``.cuda()``,
``reduce_tensor``, ``torch.cuda.synchronize`` left out), meters and logs left out.

The ports: with 4 batches an epoch, automatic (``grad_accum=2``, ``grad_clip``; the update index is
``state.step - 1``); with 5, manual: ``self.backward(loss / 2)`` each batch, ``self.step()`` on every second,
``zero_grad`` in ``on_epoch_start`` (the Trainer keeps gradients no update applied, as the docs say).
"""
import pytest
import torch
import torch.nn as nn

from safeloop import Trainer

from .harness import checks, compare_runs
from .test_deit_distillation import LabelSmoothingCrossEntropy
from .test_schedulers_real import CosineLRScheduler

EPOCHS, BATCH, ACCUMULATION_STEPS, CLIP_GRAD, WARMUP_EPOCHS = 3, 4, 2, 5.0, 1
BASE_LR = 5e-4 * BATCH / 512.0 * ACCUMULATION_STEPS * 50
WARMUP_LR = 5e-7 * BATCH / 512.0 * ACCUMULATION_STEPS
MIN_LR = 5e-6 * BATCH / 512.0 * ACCUMULATION_STEPS


class TinySwin(nn.Module):
    def __init__(self, tokens=4, in_dim=6, dim=8, num_classes=3):
        super().__init__()
        self.patch_embed = nn.Linear(in_dim, dim)
        self.absolute_pos_embed = nn.Parameter(torch.randn(1, tokens, dim) * .02)
        self.relative_position_bias_table = nn.Parameter(torch.randn(tokens, dim) * .02)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, num_classes)

    def no_weight_decay(self):
        return {'absolute_pos_embed'}

    def no_weight_decay_keywords(self):
        return {'relative_position_bias_table'}

    def forward(self, x):
        x = self.patch_embed(x) + self.absolute_pos_embed + self.relative_position_bias_table
        x = x + self.mlp(self.norm(x))
        return self.head(x.mean(1))


# -- optimizer.py -------------------------------------------------------------------------------------------
def build_optimizer(model):
    skip = {}
    skip_keywords = {}
    if hasattr(model, 'no_weight_decay'):
        skip = model.no_weight_decay()
    if hasattr(model, 'no_weight_decay_keywords'):
        skip_keywords = model.no_weight_decay_keywords()
    parameters = set_weight_decay(model, skip, skip_keywords)
    return torch.optim.AdamW(parameters, eps=1e-8, betas=(0.9, 0.999), lr=BASE_LR, weight_decay=0.05)


def set_weight_decay(model, skip_list=(), skip_keywords=()):
    has_decay = []
    no_decay = []

    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue  # frozen weights
        if len(param.shape) == 1 or name.endswith(".bias") or (name in skip_list) or \
                check_keywords_in_name(name, skip_keywords):
            no_decay.append(param)
        else:
            has_decay.append(param)
    return [{'params': has_decay},
            {'params': no_decay, 'weight_decay': 0.}]


def check_keywords_in_name(name, keywords=()):
    isin = False
    for keyword in keywords:
        if keyword in name:
            isin = True
    return isin


# -- lr_scheduler.py ----------------------------------------------------------------------------------------
def build_scheduler(optimizer, n_iter_per_epoch):
    num_steps = int(EPOCHS * n_iter_per_epoch)
    warmup_steps = int(WARMUP_EPOCHS * n_iter_per_epoch)
    return CosineLRScheduler(optimizer, t_initial=num_steps - warmup_steps, cycle_mul=1.0, lr_min=MIN_LR,
                             warmup_lr_init=WARMUP_LR, warmup_t=warmup_steps, cycle_limit=1, t_in_epochs=False,
                             warmup_prefix=True)


# -- utils.py -----------------------------------------------------------------------------------------------
def ampscaler_get_grad_norm(parameters, norm_type: float = 2.0) -> torch.Tensor:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if len(parameters) == 0:
        return torch.tensor(0.)
    device = parameters[0].grad.device
    total_norm = torch.norm(torch.stack([torch.norm(p.grad.detach(),
                                                    norm_type).to(device) for p in parameters]), norm_type)
    return total_norm


class NativeScalerWithGradNormCount:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cpu", enabled=False)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if update_grad:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
                norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            else:
                self._scaler.unscale_(optimizer)
                norm = ampscaler_get_grad_norm(parameters)
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            norm = None
        return norm

    def state_dict(self):
        return self._scaler.state_dict()


# -- main.py ------------------------------------------------------------------------------------------------
def train_one_epoch(model, criterion, data_loader, optimizer, epoch, mixup_fn, lr_scheduler, loss_scaler):
    model.train()
    optimizer.zero_grad()

    num_steps = len(data_loader)
    for idx, (samples, targets) in enumerate(data_loader):
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)

        outputs = model(samples)
        loss = criterion(outputs, targets)
        loss = loss / ACCUMULATION_STEPS

        # this attribute is added by timm on one optimizer (adahessian)
        is_second_order = hasattr(optimizer, 'is_second_order') and optimizer.is_second_order
        loss_scaler(loss, optimizer, clip_grad=CLIP_GRAD,
                    parameters=model.parameters(), create_graph=is_second_order,
                    update_grad=(idx + 1) % ACCUMULATION_STEPS == 0)
        if (idx + 1) % ACCUMULATION_STEPS == 0:
            optimizer.zero_grad()
            lr_scheduler.step_update((epoch * num_steps + idx) // ACCUMULATION_STEPS)


@torch.no_grad()
def validate(data_loader, model):
    criterion = torch.nn.CrossEntropyLoss()
    model.eval()
    return sum(criterion(model(images), target).item() for images, target in data_loader)


def swin_hand(model, data_loader_train):
    optimizer = build_optimizer(model)
    loss_scaler = NativeScalerWithGradNormCount()
    lr_scheduler = build_scheduler(optimizer, len(data_loader_train) // ACCUMULATION_STEPS)
    criterion = LabelSmoothingCrossEntropy(smoothing=0.1)
    for epoch in range(0, EPOCHS):
        train_one_epoch(model, criterion, data_loader_train, optimizer, epoch, None, lr_scheduler, loss_scaler)
        validate(data_loader_train, model)
    data_loader_train.rates = [group["lr"] for group in optimizer.param_groups]


class SwinAccumulated(Trainer):
    """``len(train_data)`` a multiple of ``ACCUMULATION_STEPS``: ``grad_accum``."""

    def configure_optimizers(self):
        self.optimizer = build_optimizer(self.model)
        self.lr_scheduler = build_scheduler(self.optimizer, len(self.train_data) // ACCUMULATION_STEPS)
        self.criterion = LabelSmoothingCrossEntropy(smoothing=0.1)
        return self.optimizer

    def training_step(self, batch):
        samples, targets = batch
        return self.criterion(self.model(samples), targets)

    def on_step_end(self, losses):
        self.lr_scheduler.step_update(self.state.step - 1)

    def on_epoch_end(self):
        validate(self.train_data, self.model)
        self.model.train()

    def on_fit_end(self):
        self.train_data.rates = [group["lr"] for group in self.optimizer.param_groups]


class SwinUnevenEpochs(SwinAccumulated):
    """An epoch's last micro-batch left out of every update: manual, its gradient dropped at the next epoch."""

    automatic = False

    def on_epoch_start(self):
        self.optimizer.zero_grad()

    def training_step(self, batch):
        samples, targets = batch
        loss = self.criterion(self.model(samples), targets)
        self.backward(loss / ACCUMULATION_STEPS)
        idx = self.state.batch_in_epoch - 1
        if (idx + 1) % ACCUMULATION_STEPS == 0:
            self.step()
            self.lr_scheduler.step_update((self.state.epoch * len(self.train_data) + idx) // ACCUMULATION_STEPS)
        return loss

    def on_step_end(self, losses):
        """Nothing: each update's rate is set in ``training_step``, where the update is (not once per step as in
        ``SwinAccumulated``)."""


class Loader(list):
    """The batches, and the rates the run ends with."""


def tokens(batches):
    def make():
        gen = torch.Generator().manual_seed(4)
        return Loader((torch.randn(BATCH, 4, 6, generator=gen), torch.randint(3, (BATCH,), generator=gen))
                      for _ in range(batches))
    return make


@pytest.mark.parametrize("check", checks())
def test_swin_accumulation_with_clipping_and_a_cosine_schedule_on_update_indices(check):
    runs = compare_runs(TinySwin, swin_hand, SwinAccumulated, tokens(4), check, steps=EPOCHS * 4 // 2,
                        grad_accum=ACCUMULATION_STEPS, grad_clip=CLIP_GRAD)
    assert runs[0].rates == runs[1].rates == runs[2].rates


@pytest.mark.parametrize("check", checks())
def test_swin_accumulation_dropping_each_epochs_last_micro_batch(check):
    runs = compare_runs(TinySwin, swin_hand, SwinUnevenEpochs, tokens(5), check, steps=EPOCHS * 5,
                        grad_clip=CLIP_GRAD)
    assert runs[0].rates == runs[1].rates == runs[2].rates
