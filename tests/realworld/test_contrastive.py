"""Contrastive self-supervised learning: MoCo, from facebookresearch/moco, moco/builder.py (MoCo, as of
the MIT relicense, commit 7397dfe) and main_moco.py (main_worker's optimizer, train).

A query encoder trained by SGD, a key encoder that takes no gradient and follows it by a momentum
update done inside the forward, through ``param.data =`` (new storage every step, on parameters the
optimizer holds), and a queue of past keys kept in a buffer and overwritten in place under
``no_grad``."""
from functools import partial

import pytest
import torch
from torch import nn

from safeloop import StepError, Trainer

from .harness import checks, compare, fixed

DIM, K, M, T, BATCH, FEATURES = 8, 16, 0.999, 0.07, 4, 6  # K % BATCH == 0, as _dequeue_and_enqueue asserts
LR, MOMENTUM, WEIGHT_DECAY = 0.03, 0.9, 1e-4  # main_moco.py's defaults
STEPS = 6  # K // BATCH = 4 steps fill the queue: the last two overwrite the oldest keys


class TinyEncoder(nn.Module):
    """Stands in for torchvision's ResNet: called as ``base_encoder(num_classes=dim)``, with BatchNorm
    and a final ``fc`` that the ``mlp`` head replaces."""

    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


class MoCo(nn.Module):
    """moco/builder.py's MoCo, single-process: the DDP-only parts (``concat_all_gather`` of the keys,
    ``_batch_shuffle_ddp`` / ``_batch_unshuffle_ddp`` for BatchNorm) need a process group and are left
    out; with one process the gather is the identity. ``labels`` stay on the CPU (no ``.cuda()``)."""

    def __init__(self, base_encoder, dim=128, K=65536, m=0.999, T=0.07, mlp=False):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        if mlp:  # hack: brute-force replacement
            dim_mlp = self.encoder_q.fc.weight.shape[1]
            self.encoder_q.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_q.fc)
            self.encoder_k.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_k.fc)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)  # initialize
            param_k.requires_grad = False  # not update by gradient
        self.register_buffer("queue", torch.randn(dim, K))
        self.queue = nn.functional.normalize(self.queue, dim=0)
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1. - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0  # for simplicity
        self.queue[:, ptr:ptr + batch_size] = keys.T  # replace the keys at ptr (dequeue and enqueue)
        ptr = (ptr + batch_size) % self.K  # move pointer
        self.queue_ptr[0] = ptr

    def forward(self, im_q, im_k):
        q = nn.functional.normalize(self.encoder_q(im_q), dim=1)  # queries: NxC
        with torch.no_grad():  # no gradient to keys
            self._momentum_update_key_encoder()
            k = nn.functional.normalize(self.encoder_k(im_k), dim=1)  # keys: NxC
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)  # positive logits: Nx1
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])  # negative logits: NxK
        logits = torch.cat([l_pos, l_neg], dim=1)
        logits /= self.T  # in place on the graph: cat saves nothing that division would spoil
        labels = torch.zeros(logits.shape[0], dtype=torch.long)  # positive key indicators
        self._dequeue_and_enqueue(k)
        return logits, labels


def moco():
    return MoCo(TinyEncoder, DIM, K, M, T, mlp=True)  # the mlp head: MoCo v2's --mlp


def moco_opt(params):
    # model.parameters(): the key encoder's frozen parameters too; they never get a gradient, so SGD skips them
    return torch.optim.SGD(params, LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def two_crops(n, seed=11):
    """TwoCropsTransform over an ImageFolder: ``(images, target)`` with two noisy views of one batch and
    a class label the training ignores."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(BATCH, FEATURES, generator=gen)
        views = [x + 0.1 * torch.randn(BATCH, FEATURES, generator=gen) for _ in range(2)]
        out.append((views, torch.zeros(BATCH, dtype=torch.long)))
    return out


def moco_hand(model, data):
    criterion = nn.CrossEntropyLoss()
    optimizer = moco_opt(model.parameters())
    model.train()
    for images, _ in data:
        output, target = model(im_q=images[0], im_k=images[1])
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


class MoCoTrainer(Trainer):
    """The MoCo module is the Trainer's model: the momentum update and the queue stay in its forward."""

    criterion = nn.CrossEntropyLoss()

    def configure_optimizers(self):
        return moco_opt(self.model.parameters())

    def training_step(self, batch):
        images, _ = batch
        output, target = self.model(im_q=images[0], im_k=images[1])
        return self.criterion(output, target)


@pytest.mark.parametrize("check", checks())
def test_moco(check):
    compare(moco, moco_hand, MoCoTrainer, fixed(two_crops(STEPS)), check, steps=STEPS)


@pytest.mark.parametrize("check", checks())
def test_moco_with_full_undo(check):
    """undo=full snapshots the optimizer before every update, just after the forward gave the key encoder's
    parameters new storage: taking the snapshot must leave training unchanged."""
    compare(moco, moco_hand, MoCoTrainer, fixed(two_crops(STEPS)), check, steps=STEPS, undo="full")


class FailingAfterTheUpdate(MoCoTrainer):
    """Keeps what the third forward left (its momentum update made); that step's scheduler then raises."""

    forwards, after_forward = 0, None

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.forwards += 1
        if self.forwards == 3:
            self.after_forward = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        return loss


def fails_at_third_step(epoch):
    if epoch == 3:
        raise ValueError("the scheduler fails")
    return 1.0


def test_moco_full_undo_restores_the_storage_the_forward_gave():
    """A snapshot still reading the key encoder's previous storage would put last step's keys back."""
    torch.manual_seed(0)
    model = moco()
    trainer = FailingAfterTheUpdate(model=model, train_data=two_crops(STEPS), max_steps=STEPS, device="cpu",
                                    progress=False, loggers=(), undo="full",
                                    scheduler=partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=fails_at_third_step))
    with pytest.raises(StepError, match="parameters and optimizer state are unchanged"):
        trainer.fit()
    assert trainer.state.step == 2
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, trainer.after_forward[name])]
    assert not changed, f"parameters not restored to what the failed step's forward left: {changed}"
