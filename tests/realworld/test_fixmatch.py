"""FixMatch: kekmodel/FixMatch-pytorch, train.py at commit f54946074fba383e28320d8f50b627eabd0c7e3c (``train``,
``interleave``, ``de_interleave``, ``get_cosine_schedule_with_warmup``, the optimizer's two groups) and
models/ema.py at commit 33d58c74928a0765f2e2a0fea057be2a7e221b5a (``ModelEMA``).

Each step concatenates a labelled batch with ``mu`` times as many unlabelled images in a weak and a strong view,
interleaves them (so that BatchNorm sees a mix), runs one forward, de-interleaves and splits the logits. The weak
view's logits, detached, give pseudo-labels and a confidence mask; the strong view's cross-entropy against them,
masked, is added to the labelled loss: one backward. Nesterov SGD in two groups (no decay on ``bias`` and ``bn``),
a per-step cosine ``LambdaLR``, then ``ModelEMA.update``: a deep copy in eval mode (its parameters frozen) moved
by ``esd[k].copy_`` through its ``state_dict`` under ``no_grad``, its buffers copied from the model's;
``model.zero_grad()`` after it. The two loaders are cycled by hand (``iter`` again when one runs out).

Changes for a seconds-long test: a two-layer MLP with BatchNorm (momentum 0.001) and in-place LeakyReLU (the
WideResNet's), 2 labelled and 2 * ``mu`` = 4 unlabelled samples a step, 3 classes, a threshold of 0.4 (0.95, which
the tiny model never reaches), 2 "epochs" of 3 steps (``eval_step``) over loaders of 2 labelled and 4 unlabelled
batches (so the labelled one is restarted mid-epoch); Gaussian noise of two sizes for the weak and strong
augmentations; ``labeled_iter.next()`` (gone from Python 3 iterators: the bare ``except`` would restart the
loader every step, then fail) written ``next(labeled_iter)``; no apex, evaluation, logging or saving.

The port's data iterator cycles the loaders as the loop does; ``on_step_end`` updates the EMA model.
"""
import math
from copy import deepcopy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import LambdaLR

from safeloop import GraphGuard, Trainer
from safeloop.watch import Watch

from .harness import assert_same, checks, strict

args = SimpleNamespace(mu=2, T=1, threshold=0.4, lambda_u=1, lr=0.03, wdecay=5e-4, nesterov=True, warmup=0,
                       eval_step=3, epochs=2, ema_decay=0.999, use_ema=True, device=torch.device("cpu"))
args.total_steps = args.epochs * args.eval_step
BATCH, FEATURES, CLASSES = 2, 5, 3


class ModelEMA(object):
    def __init__(self, args, model, decay):
        self.ema = deepcopy(model)
        self.ema.to(args.device)
        self.ema.eval()
        self.decay = decay
        self.ema_has_module = hasattr(self.ema, 'module')
        # Fix EMA. https://github.com/valencebond/FixMatch_pytorch thank you!
        self.param_keys = [k for k, _ in self.ema.named_parameters()]
        self.buffer_keys = [k for k, _ in self.ema.named_buffers()]
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        needs_module = hasattr(model, 'module') and not self.ema_has_module
        with torch.no_grad():
            msd = model.state_dict()
            esd = self.ema.state_dict()
            for k in self.param_keys:
                if needs_module:
                    j = 'module.' + k
                else:
                    j = k
                model_v = msd[j].detach()
                ema_v = esd[k]
                esd[k].copy_(ema_v * self.decay + (1. - self.decay) * model_v)

            for k in self.buffer_keys:
                if needs_module:
                    j = 'module.' + k
                else:
                    j = k
                esd[k].copy_(msd[j])


def get_cosine_schedule_with_warmup(optimizer,
                                    num_warmup_steps,
                                    num_training_steps,
                                    num_cycles=7./16.,
                                    last_epoch=-1):
    def _lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        no_progress = float(current_step - num_warmup_steps) / \
            float(max(1, num_training_steps - num_warmup_steps))
        return max(0., math.cos(math.pi * num_cycles * no_progress))

    return LambdaLR(optimizer, _lr_lambda, last_epoch)


def interleave(x, size):
    s = list(x.shape)
    return x.reshape([-1, size] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def de_interleave(x, size):
    s = list(x.shape)
    return x.reshape([size, -1] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


class TinyNet(nn.Module):
    """WideResNet's pieces at test size: BatchNorm with momentum 0.001, in-place LeakyReLU(0.1), a ``fc``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Linear(FEATURES, 8)
        self.bn1 = nn.BatchNorm1d(8, momentum=0.001)
        self.relu = nn.LeakyReLU(negative_slope=0.1, inplace=True)
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.fc(self.relu(self.bn1(self.conv1(x))))


def make_optimizer(model):
    no_decay = ['bias', 'bn']
    grouped_parameters = [
        {'params': [p for n, p in model.named_parameters() if not any(
            nd in n for nd in no_decay)], 'weight_decay': args.wdecay},
        {'params': [p for n, p in model.named_parameters() if any(
            nd in n for nd in no_decay)], 'weight_decay': 0.0}
    ]
    return optim.SGD(grouped_parameters, lr=args.lr,
                     momentum=0.9, nesterov=args.nesterov)


def loaders():
    gen = torch.Generator().manual_seed(8)
    labeled = [(torch.randn(BATCH, FEATURES, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
               for _ in range(2)]
    unlabeled = []
    for _ in range(4):
        x = torch.randn(BATCH * args.mu, FEATURES, generator=gen)
        weak = x + 0.05 * torch.randn(x.shape, generator=gen)
        strong = x + 0.5 * torch.randn(x.shape, generator=gen)
        unlabeled.append(((weak, strong), torch.zeros(BATCH * args.mu, dtype=torch.long)))
    return labeled, unlabeled


def cycled(labeled_trainloader, unlabeled_trainloader, steps):
    """train's drawing of the two loaders, each restarted when it runs out."""
    labeled_iter = iter(labeled_trainloader)
    unlabeled_iter = iter(unlabeled_trainloader)
    for _ in range(steps):
        try:
            inputs_x, targets_x = next(labeled_iter)
        except:
            labeled_iter = iter(labeled_trainloader)
            inputs_x, targets_x = next(labeled_iter)

        try:
            (inputs_u_w, inputs_u_s), _ = next(unlabeled_iter)
        except:
            unlabeled_iter = iter(unlabeled_trainloader)
            (inputs_u_w, inputs_u_s), _ = next(unlabeled_iter)
        yield inputs_x, targets_x, inputs_u_w, inputs_u_s


def fixmatch_loss(model, inputs_x, targets_x, inputs_u_w, inputs_u_s):
    batch_size = inputs_x.shape[0]
    inputs = interleave(
        torch.cat((inputs_x, inputs_u_w, inputs_u_s)), 2*args.mu+1).to(args.device)
    targets_x = targets_x.to(args.device)
    logits = model(inputs)
    logits = de_interleave(logits, 2*args.mu+1)
    logits_x = logits[:batch_size]
    logits_u_w, logits_u_s = logits[batch_size:].chunk(2)
    del logits

    Lx = F.cross_entropy(logits_x, targets_x, reduction='mean')

    pseudo_label = torch.softmax(logits_u_w.detach()/args.T, dim=-1)
    max_probs, targets_u = torch.max(pseudo_label, dim=-1)
    mask = max_probs.ge(args.threshold).float()

    Lu = (F.cross_entropy(logits_u_s, targets_u,
                          reduction='none') * mask).mean()

    return Lx + args.lambda_u * Lu, mask


def fixmatch_hand(model, data):
    labeled_trainloader, unlabeled_trainloader = data
    optimizer = make_optimizer(model)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.total_steps)
    ema_model = ModelEMA(args, model, args.ema_decay)
    model.zero_grad()

    draws = cycled(labeled_trainloader, unlabeled_trainloader, args.total_steps)
    model.train()
    for epoch in range(0, args.epochs):
        for batch_idx in range(args.eval_step):
            inputs_x, targets_x, inputs_u_w, inputs_u_s = next(draws)
            loss, mask = fixmatch_loss(model, inputs_x, targets_x, inputs_u_w, inputs_u_s)
            loss.backward()

            optimizer.step()
            scheduler.step()
            if args.use_ema:
                ema_model.update(model)
            model.zero_grad()
            mask_prob = mask.mean().item()
    return ema_model


class FixMatchTrainer(Trainer):
    def configure_optimizers(self):
        self.ema_model = ModelEMA(args, self.model, args.ema_decay)
        optimizer = make_optimizer(self.model)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": get_cosine_schedule_with_warmup(optimizer, args.warmup, args.total_steps),
            "interval": "step"}}

    def training_step(self, batch):
        loss, mask = fixmatch_loss(self.model, *batch)
        self.log("mask", mask.mean())
        return loss

    def on_step_end(self, losses):
        self.ema_model.update(self.model)


class Draws:
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return args.total_steps

    def __iter__(self):
        return cycled(*self.data, args.total_steps)


@pytest.mark.parametrize("check", checks())
def test_fixmatch_with_interleaved_views_pseudo_labels_and_an_ema_model(check):
    torch.manual_seed(0)
    ref = TinyNet()
    ours, watched, start = deepcopy(ref), deepcopy(ref), deepcopy(ref)
    ref_ema = fixmatch_hand(ref, loaders())
    with strict([]), Watch(GraphGuard(check=check), fixmatch_hand.__code__.co_filename):  # as harness.compare
        watched_ema = fixmatch_hand(watched, loaders())
    assert_same(watched, ref)
    assert_same(watched_ema.ema, ref_ema.ema)
    with strict([]):
        trainer = FixMatchTrainer(model=ours, train_data=Draws(loaders()), max_steps=args.total_steps, device="cpu",
                                  progress=False, loggers=(), guard={"check": check})
        trainer.fit()
    assert_same(ours, ref)
    assert_same(trainer.ema_model.ema, ref_ema.ema)
    assert not torch.equal(ref.conv1.weight, start.conv1.weight)
    torch.manual_seed(0)
    masks = [fixmatch_loss(TinyNet(), *draw)[1].mean() for draw in cycled(*loaders(), args.total_steps)]
    assert 0 < sum(masks) < len(masks)  # some pseudo-labels pass the threshold, not all
