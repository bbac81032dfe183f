"""Mean teacher with its schedules and two heads: CuriousAI/mean-teacher (546348ff863c998c26be4339021425df973b4a36),
``pytorch/main.py`` (``train``, ``update_ema_variables``, ``adjust_learning_rate``,
``get_current_consistency_weight``, ``create_model(ema=True)``), ``pytorch/mean_teacher/ramps.py`` and
``pytorch/mean_teacher/losses.py`` (verbatim but for ``size_average=False``, written ``reduction='sum'``), with
``experiments/cifar10_test.py``'s costs (MSE consistency of weight 100 ramped up over 5 epochs, a residual logit
distance cost of 0.01, so two heads; weight decay 2e-4, Nesterov).

``test_models::test_mean_teacher`` covers the configuration without either schedule or the second head. New here:

- the learning rate assigned to every parameter group before each iteration from the fractional epoch
  ``epoch + i / len(train_loader)``, a linear warm-up then a cosine ramp-down (``--lr-rampup 1``,
  ``--lr-rampdown-epochs 4`` here; the experiment's are 0 and 210);
- the consistency weight, a sigmoid ramp-up of the epoch (a NumPy computation returned as a float);
- two heads: the class loss on the first, the consistency loss on the second, and the symmetric MSE between them
  (``res_loss``) sending gradient to both; the teacher's class loss computed and not trained (a meter);
- the teacher (parameters detached in place, BatchNorm in train mode) run outside ``no_grad`` (the source's
  ``volatile=True``, which modern PyTorch ignores), updated after each step with ``global_step``.

Changes for a seconds-long test: a two-headed MLP with BatchNorm for the Shake-Shake ResNet (whose two ``fc``
heads it keeps), 3 epochs of 2 fixed batches of 8 with half the labels ``NO_LABEL`` (the two-stream sampler's
31 labelled of 128), ``--lr 0.05``; the meters, logging, checkpoints and validation left out.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.nn import functional as F

from safeloop import Trainer

from .harness import assert_same, checks, compare, fixed
from .test_resume_ports import straight_and_resumed

NO_LABEL = -1
args = SimpleNamespace(lr=0.05, initial_lr=0.0, lr_rampup=1, lr_rampdown_epochs=4, epochs=3, momentum=0.9,
                       nesterov=True, weight_decay=2e-4, ema_decay=0.999, consistency=100.0, consistency_rampup=5,
                       consistency_type='mse', logit_distance_cost=.01)


# -- pytorch/mean_teacher/ramps.py --------------------------------------------------------------------------------
def sigmoid_rampup(current, rampup_length):
    """Exponential rampup from https://arxiv.org/abs/1610.02242"""
    if rampup_length == 0:
        return 1.0
    else:
        current = np.clip(current, 0.0, rampup_length)
        phase = 1.0 - current / rampup_length
        return float(np.exp(-5.0 * phase * phase))


def linear_rampup(current, rampup_length):
    """Linear rampup"""
    assert current >= 0 and rampup_length >= 0
    if current >= rampup_length:
        return 1.0
    else:
        return current / rampup_length


def cosine_rampdown(current, rampdown_length):
    """Cosine rampdown from https://arxiv.org/abs/1608.03983"""
    assert 0 <= current <= rampdown_length
    return float(.5 * (np.cos(np.pi * current / rampdown_length) + 1))


# -- pytorch/mean_teacher/losses.py -------------------------------------------------------------------------------
def softmax_mse_loss(input_logits, target_logits):
    """Takes softmax on both sides and returns MSE loss"""
    assert input_logits.size() == target_logits.size()
    input_softmax = F.softmax(input_logits, dim=1)
    target_softmax = F.softmax(target_logits, dim=1)
    num_classes = input_logits.size()[1]
    return F.mse_loss(input_softmax, target_softmax, reduction='sum') / num_classes


def symmetric_mse_loss(input1, input2):
    """Like F.mse_loss but sends gradients to both directions"""
    assert input1.size() == input2.size()
    num_classes = input1.size()[1]
    return torch.sum((input1 - input2)**2) / num_classes


# -- pytorch/main.py ----------------------------------------------------------------------------------------------
class TwoHeads(nn.Module):
    """Stands for ``cifar_shakeshake26``: a trunk and its two ``fc`` heads."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.fc1, self.fc2 = nn.Linear(8, num_classes), nn.Linear(8, num_classes)

    def forward(self, x):
        h = self.trunk(x)
        return self.fc1(h), self.fc2(h)


def create_model(ema=False):
    model = TwoHeads()
    if ema:
        for param in model.parameters():
            param.detach_()
    return model


def student_and_teacher():
    pair = nn.Module()
    pair.model = create_model()
    pair.ema_model = create_model(ema=True)
    return pair


def update_ema_variables(model, ema_model, alpha, global_step):
    # Use the true average until the exponential average is more correct
    alpha = min(1 - 1 / (global_step + 1), alpha)
    for ema_param, param in zip(ema_model.parameters(), model.parameters()):
        ema_param.data.mul_(alpha).add_(param.data, alpha=1 - alpha)


def adjust_learning_rate(optimizer, epoch, step_in_epoch, total_steps_in_epoch):
    lr = args.lr
    epoch = epoch + step_in_epoch / total_steps_in_epoch

    # LR warm-up to handle large minibatch sizes from https://arxiv.org/abs/1706.02677
    lr = linear_rampup(epoch, args.lr_rampup) * (args.lr - args.initial_lr) + args.initial_lr

    # Cosine LR rampdown from https://arxiv.org/abs/1608.03983 (but one cycle only)
    if args.lr_rampdown_epochs:
        assert args.lr_rampdown_epochs >= args.epochs
        lr *= cosine_rampdown(epoch, args.lr_rampdown_epochs)

    for param_group in optimizer.param_groups:
        param_group['lr'] = lr


def get_current_consistency_weight(epoch):
    # Consistency ramp-up from https://arxiv.org/abs/1610.02242
    return args.consistency * sigmoid_rampup(epoch, args.consistency_rampup)


def make_optimizer(params):
    return torch.optim.SGD(params, args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                           nesterov=args.nesterov)


def mean_teacher_loss(model, ema_model, input, ema_input, target, epoch):
    """``train``'s body from the forwards to ``loss`` (the accuracy meters left out)."""
    class_criterion = nn.CrossEntropyLoss(reduction='sum', ignore_index=NO_LABEL)
    consistency_criterion = softmax_mse_loss
    residual_logit_criterion = symmetric_mse_loss

    input_var = torch.autograd.Variable(input)
    ema_input_var = torch.autograd.Variable(ema_input)
    target_var = torch.autograd.Variable(target)

    minibatch_size = len(target_var)
    labeled_minibatch_size = target_var.data.ne(NO_LABEL).sum()
    assert labeled_minibatch_size > 0

    ema_model_out = ema_model(ema_input_var)
    model_out = model(input_var)

    if isinstance(model_out, Variable):
        assert args.logit_distance_cost < 0
        logit1 = model_out
        ema_logit = ema_model_out
    else:
        assert len(model_out) == 2
        assert len(ema_model_out) == 2
        logit1, logit2 = model_out
        ema_logit, _ = ema_model_out

    ema_logit = Variable(ema_logit.detach().data, requires_grad=False)

    if args.logit_distance_cost >= 0:
        class_logit, cons_logit = logit1, logit2
        res_loss = args.logit_distance_cost * residual_logit_criterion(class_logit, cons_logit) / minibatch_size
    else:
        class_logit, cons_logit = logit1, logit1
        res_loss = 0

    class_loss = class_criterion(class_logit, target_var) / minibatch_size

    ema_class_loss = class_criterion(ema_logit, target_var) / minibatch_size  # a meter only

    consistency_weight = get_current_consistency_weight(epoch)
    consistency_loss = consistency_weight * consistency_criterion(cons_logit, ema_logit) / minibatch_size

    loss = class_loss + consistency_loss + res_loss
    assert not (np.isnan(loss.item()) or loss.item() > 1e5), 'Loss explosion: {}'.format(loss.item())
    return loss, ema_class_loss


def mean_teacher_hand(pair, train_loader):
    model, ema_model = pair.model, pair.ema_model
    optimizer = make_optimizer(model.parameters())
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        ema_model.train()
        for i, ((input, ema_input), target) in enumerate(train_loader):
            adjust_learning_rate(optimizer, epoch, i, len(train_loader))
            loss, _ = mean_teacher_loss(model, ema_model, input, ema_input, target, epoch)

            # compute gradient and do SGD step
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1
            update_ema_variables(model, ema_model, args.ema_decay, global_step)


class MeanTeacher(Trainer):
    """The learning rate set in ``on_step_start`` (``batch_in_epoch`` counts the step's own batch: ``i + 1``), the
    teacher updated in ``on_step_end`` (``state.step`` counts the step: ``global_step``); the teacher's class loss
    logged."""

    def configure_optimizers(self):
        return make_optimizer(self.model.model.parameters())

    def on_step_start(self):
        adjust_learning_rate(self.optimizers["optimizer"], self.state.epoch, self.state.batch_in_epoch - 1,
                             len(self.train_data))

    def training_step(self, batch):
        (input, ema_input), target = batch
        loss, ema_class_loss = mean_teacher_loss(self.model.model, self.model.ema_model, input, ema_input, target,
                                                 self.state.epoch)
        self.log("ema_class_loss", ema_class_loss)
        return loss

    def on_step_end(self, losses):
        update_ema_variables(self.model.model, self.model.ema_model, args.ema_decay, self.state.step)


def two_views(n):
    gen = torch.Generator().manual_seed(12)
    out = []
    for _ in range(n):
        x = torch.randn(8, 4, generator=gen)
        target = torch.randint(3, (8,), generator=gen)
        target[1::2] = NO_LABEL
        out.append(((x + 0.1 * torch.randn(8, 4, generator=gen), x + 0.1 * torch.randn(8, 4, generator=gen)),
                    target))
    return out


@pytest.mark.parametrize("check", checks())
def test_mean_teacher_with_lr_and_consistency_ramps_and_two_heads(check):
    compare(student_and_teacher, mean_teacher_hand, MeanTeacher, fixed(two_views(2)), check, steps=args.epochs * 2)


@pytest.mark.filterwarnings("error")
def test_mean_teacher_with_ramps_resumed_midway(tmp_path):
    """Stopped in the second epoch: the fractional epoch of the learning rate and the teacher's ``global_step``
    go on from the checkpoint's ``state``."""
    straight, resumed = straight_and_resumed(tmp_path, student_and_teacher, MeanTeacher, fixed(two_views(2)),
                                             args.epochs * 2, 3)
    assert_same(resumed.model, straight.model)
