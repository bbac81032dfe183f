"""AdaHessian: an optimizer whose ``step()`` differentiates the gradients themselves, so the backward before it
must build their graph (``loss.backward(create_graph=True)``).

- davda54/ada-hessian (5e1bebc21b64ff9c02f8c42e2b0afe9baac364d8): ``ada_hessian.py`` (``AdaHessian``, verbatim
  but for its docstring's argument list, left out, and long lines wrapped),
  ``example/train.py`` (the loop: ``zero_grad``, forward, ``loss.mean().backward(create_graph=True)``, ``step``,
  then the ``StepLR`` of ``example/utility/step_lr.py`` called with the epoch under ``no_grad`` after every step),
  ``example/model/smooth_cross_entropy.py`` and ``example/model/wide_res_net.py`` (verbatim). Inside ``step()``,
  under ``no_grad``, ``set_hessian`` takes Hutchinson's estimate of the Hessian's diagonal with
  ``torch.autograd.grad([p.grad ...], params, grad_outputs=zs)`` (Rademacher ``zs`` from the optimizer's own
  ``torch.Generator``), kept on each parameter as an attribute (``p.hess``), then the update is written in place
  (``p.mul_``, ``p.addcdiv_``) while ``p.grad`` still holds its graph, until the next ``zero_grad``.
- amirgholami/adahessian (85ebc00ce873c8497a64ca80bbfa5d996109efea), the authors' code:
  ``image_classification/optim_adahessian.py`` (``Adahessian``, verbatim but for the distributed branch, which
  needs ``single_gpu=False``, and the docstrings shortened) and ``image_classification/main.py`` (forward,
  ``backward(create_graph=True)``, ``step``, then ``zero_grad``; a ``MultiStepLR`` stepped at each epoch's start).
  Its ``step()`` runs with grad enabled, draws its Rademacher vectors from torch's global generator
  (``torch.randint_like``), calls ``autograd.grad(..., retain_graph=True)``, detaches each gradient in place
  (``grad.detach_()``) and replaces each parameter's data (``p.data = p.data - ...``).

Changes for a seconds-long test: a Wide-ResNet of depth 4 and width 1 (16 and 8) on 2 CIFAR-sized images a batch,
2 batches an epoch and 3 epochs (200); the second case a small MLP for the authors' ResNet, 3 epochs of 2 batches
(160) with the decay at epoch 2 (80 and 120); the logs, the evaluation, the progress bar and DataParallel left out.

The ports run in manual mode: ``self.backward(loss, create_graph=True)``, as Lightning's
``manual_backward(loss, create_graph=True)``; the gradient with its graph taken by
``torch.autograd.grad(loss, params, create_graph=True)`` and assigned to ``p.grad`` (which writes the same values as
the source's backward into ``None`` gradients); or the source's own ``loss.backward(create_graph=True)`` inside
``training_step``; then ``self.step()``.

The port a Lightning user may write first, an automatic-mode Trainer overriding ``backward(self, loss, ...)`` to
pass ``create_graph=True`` (Lightning's ``LightningModule.backward`` hook), would never be called: the Trainer
back-propagates itself. It is a ``ConfigError`` at start-up saying to use manual mode, as is a port keeping
Lightning's ``setup(self, stage)``, which would replace the Trainer's own ``setup``.

Resumed midway, the port trains as the run that never stopped: the optimizer's generator, an attribute outside
its ``state_dict()``, is kept by checkpoints (it used to be saved by hand, as the port above still does).
"""
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import lr_scheduler

from safeloop import ConfigError, Trainer

from .harness import assert_same, checks, compare, fixed
from .test_resume_ports import straight_and_resumed


# -- davda54/ada-hessian, ada_hessian.py --------------------------------------------------------------------------
class AdaHessian(torch.optim.Optimizer):
    """
    Implements the AdaHessian algorithm from "ADAHESSIAN: An Adaptive Second OrderOptimizer for Machine Learning"
    """

    def __init__(self, params, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 hessian_power=1.0, update_each=1, n_samples=1, average_conv_kernel=False):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= hessian_power <= 1.0:
            raise ValueError(f"Invalid Hessian power value: {hessian_power}")

        self.n_samples = n_samples
        self.update_each = update_each
        self.average_conv_kernel = average_conv_kernel

        # use a separate generator that deterministically generates the same `z`s across all GPUs in case of
        # distributed training
        self.generator = torch.Generator().manual_seed(2147483647)

        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, hessian_power=hessian_power)
        super(AdaHessian, self).__init__(params, defaults)

        for p in self.get_params():
            p.hess = 0.0
            self.state[p]["hessian step"] = 0

    def get_params(self):
        """
        Gets all parameters in all param_groups with gradients
        """

        return (p for group in self.param_groups for p in group['params'] if p.requires_grad)

    def zero_hessian(self):
        """
        Zeros out the accumalated hessian traces.
        """

        for p in self.get_params():
            if not isinstance(p.hess, float) and self.state[p]["hessian step"] % self.update_each == 0:
                p.hess.zero_()

    @torch.no_grad()
    def set_hessian(self):
        """
        Computes the Hutchinson approximation of the hessian trace and accumulates it for each trainable parameter.
        """

        params = []
        for p in filter(lambda p: p.grad is not None, self.get_params()):
            if self.state[p]["hessian step"] % self.update_each == 0:  # compute the trace only each `update_each` step
                params.append(p)
            self.state[p]["hessian step"] += 1

        if len(params) == 0:
            return

        if self.generator.device != params[0].device:  # hackish way of casting the generator to the right device
            self.generator = torch.Generator(params[0].device).manual_seed(2147483647)

        grads = [p.grad for p in params]

        for i in range(self.n_samples):
            zs = [torch.randint(0, 2, p.size(), generator=self.generator, device=p.device) * 2.0 - 1.0
                  for p in params]  # Rademacher distribution {-1.0, 1.0}
            h_zs = torch.autograd.grad(grads, params, grad_outputs=zs, only_inputs=True,
                                       retain_graph=i < self.n_samples - 1)
            for h_z, z, p in zip(h_zs, zs, params):
                p.hess += h_z * z / self.n_samples  # approximate the expected values of z*(H@z)

    @torch.no_grad()
    def step(self, closure=None):
        """
        Performs a single optimization step.
        Arguments:
            closure (callable, optional) -- a closure that reevaluates the model and returns the loss (default: None)
        """

        loss = None
        if closure is not None:
            loss = closure()

        self.zero_hessian()
        self.set_hessian()

        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None or p.hess is None:
                    continue

                if self.average_conv_kernel and p.dim() == 4:
                    p.hess = torch.abs(p.hess).mean(dim=[2, 3], keepdim=True).expand_as(p.hess).clone()

                # Perform correct stepweight decay as in AdamW
                p.mul_(1 - group['lr'] * group['weight_decay'])

                state = self.state[p]

                # State initialization
                if len(state) == 1:
                    state['step'] = 0
                    state['exp_avg'] = torch.zeros_like(p.data)  # Exponential moving average of gradient values
                    # Exponential moving average of Hessian diagonal square values
                    state['exp_hessian_diag_sq'] = torch.zeros_like(p.data)

                exp_avg, exp_hessian_diag_sq = state['exp_avg'], state['exp_hessian_diag_sq']
                beta1, beta2 = group['betas']
                state['step'] += 1

                # Decay the first and second moment running average coefficient
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_hessian_diag_sq.mul_(beta2).addcmul_(p.hess, p.hess, value=1 - beta2)

                bias_correction1 = 1 - beta1 ** state['step']
                bias_correction2 = 1 - beta2 ** state['step']

                k = group['hessian_power']
                denom = (exp_hessian_diag_sq / bias_correction2).pow_(k / 2).add_(group['eps'])

                # make update
                step_size = group['lr'] / bias_correction1
                p.addcdiv_(exp_avg, denom, value=-step_size)

        return loss


# -- example/model/smooth_cross_entropy.py ------------------------------------------------------------------------
def smooth_crossentropy(pred, gold, smoothing=0.1):
    n_class = pred.size(1)

    one_hot = torch.full_like(pred, fill_value=smoothing / (n_class - 1))
    one_hot.scatter_(dim=1, index=gold.unsqueeze(1), value=1.0 - smoothing)
    log_prob = F.log_softmax(pred, dim=1)

    return F.kl_div(input=log_prob, target=one_hot, reduction='none').sum(-1)


# -- example/utility/step_lr.py -----------------------------------------------------------------------------------
class StepLR:
    def __init__(self, optimizer, learning_rate: float, total_epochs: int):
        self.optimizer = optimizer
        self.total_epochs = total_epochs
        self.base = learning_rate

    def __call__(self, epoch):
        if epoch < self.total_epochs * 3/10:
            lr = self.base
        elif epoch < self.total_epochs * 6/10:
            lr = self.base * 0.2
        elif epoch < self.total_epochs * 8/10:
            lr = self.base * 0.2 ** 2
        else:
            lr = self.base * 0.2 ** 3

        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


# -- example/model/wide_res_net.py --------------------------------------------------------------------------------
class BasicUnit(nn.Module):
    def __init__(self, channels: int, dropout: float):
        super(BasicUnit, self).__init__()
        self.block = nn.Sequential(OrderedDict([
            ("0_normalization", nn.BatchNorm2d(channels)),
            ("1_activation", nn.ReLU(inplace=True)),
            ("2_convolution", nn.Conv2d(channels, channels, (3, 3), stride=1, padding=1, bias=False)),
            ("3_normalization", nn.BatchNorm2d(channels)),
            ("4_activation", nn.ReLU(inplace=True)),
            ("5_dropout", nn.Dropout(dropout, inplace=True)),
            ("6_convolution", nn.Conv2d(channels, channels, (3, 3), stride=1, padding=1, bias=False)),
        ]))

    def forward(self, x):
        return self.block(x)


class DownsampleUnit(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, dropout: float):
        super(DownsampleUnit, self).__init__()
        self.norm_act = nn.Sequential(OrderedDict([
            ("0_normalization", nn.BatchNorm2d(in_channels)),
            ("1_activation", nn.ReLU(inplace=True)),
        ]))
        self.block = nn.Sequential(OrderedDict([
            ("0_convolution", nn.Conv2d(in_channels, out_channels, (3, 3), stride=stride, padding=1, bias=False)),
            ("1_normalization", nn.BatchNorm2d(out_channels)),
            ("2_activation", nn.ReLU(inplace=True)),
            ("3_dropout", nn.Dropout(dropout, inplace=True)),
            ("4_convolution", nn.Conv2d(out_channels, out_channels, (3, 3), stride=1, padding=1, bias=False)),
        ]))
        self.downsample = nn.Conv2d(in_channels, out_channels, (1, 1), stride=stride, padding=0, bias=False)

    def forward(self, x):
        x = self.norm_act(x)
        return self.block(x) + self.downsample(x)


class Block(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, depth: int, dropout: float):
        super(Block, self).__init__()
        self.block = nn.Sequential(
            DownsampleUnit(in_channels, out_channels, stride, dropout),
            *(BasicUnit(out_channels, dropout) for _ in range(depth))
        )

    def forward(self, x):
        return self.block(x)


class WideResNet(nn.Module):
    def __init__(self, depth: int, width_factor: int, dropout: float, in_channels: int, labels: int):
        super(WideResNet, self).__init__()

        self.filters = [16, 1 * 16 * width_factor, 2 * 16 * width_factor, 4 * 16 * width_factor]
        self.block_depth = (depth - 4) // (3 * 2)

        self.f = nn.Sequential(OrderedDict([
            ("0_convolution", nn.Conv2d(in_channels, self.filters[0], (3, 3), stride=1, padding=1, bias=False)),
            ("1_block", Block(self.filters[0], self.filters[1], 1, self.block_depth, dropout)),
            ("2_block", Block(self.filters[1], self.filters[2], 2, self.block_depth, dropout)),
            ("3_block", Block(self.filters[2], self.filters[3], 2, self.block_depth, dropout)),
            ("4_normalization", nn.BatchNorm2d(self.filters[3])),
            ("5_activation", nn.ReLU(inplace=True)),
            ("6_pooling", nn.AvgPool2d(kernel_size=8)),
            ("7_flattening", nn.Flatten()),
            ("8_classification", nn.Linear(in_features=self.filters[3], out_features=labels)),
        ]))

        self._initialize()

    def _initialize(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight.data, mode="fan_in", nonlinearity="relu")
                if m.bias is not None:
                    m.bias.data.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()
            elif isinstance(m, nn.Linear):
                m.weight.data.zero_()
                m.bias.data.zero_()

    def forward(self, x):
        return self.f(x)


# -- example/train.py ---------------------------------------------------------------------------------------------
EPOCHS, PER_EPOCH, LR, WEIGHT_DECAY, UPDATE_EACH = 3, 2, 0.01, 0.0005, 1


def make_wrn():
    return WideResNet(4, 1, 0.0, in_channels=3, labels=10)


def make_optimizer(model):
    return AdaHessian(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, update_each=UPDATE_EACH,
                      average_conv_kernel=False)


def cifar():
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(2, 3, 32, 32, generator=gen), torch.randint(10, (2,), generator=gen))
            for _ in range(PER_EPOCH)]


def davda54_hand(model, train):
    optimizer = make_optimizer(model)
    scheduler = StepLR(optimizer, LR, EPOCHS)

    for epoch in range(EPOCHS):
        model.train()

        for i, (inputs, labels) in enumerate(train):
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = smooth_crossentropy(outputs, labels)
            loss.mean().backward(create_graph=True)
            optimizer.step()

            with torch.no_grad():
                scheduler(epoch)


class AdaHessianTrainer(Trainer):
    """The gradient with its graph from ``torch.autograd.grad(..., create_graph=True)``, assigned to ``.grad``."""
    automatic = False

    def configure_optimizers(self):
        optimizer = make_optimizer(self.model)
        self.scheduler = StepLR(optimizer, LR, EPOCHS)
        return optimizer

    def training_step(self, batch):
        inputs, labels = batch
        loss = smooth_crossentropy(self.model(inputs), labels)
        self.gradient(loss.mean())
        self.step()
        with torch.no_grad():
            self.scheduler(self.state.epoch)
        return loss.mean()

    def gradient(self, loss):
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p, g in zip(params, torch.autograd.grad(loss, params, create_graph=True)):
            p.grad = g


class SourceBackwardTrainer(AdaHessianTrainer):
    """The source's own ``loss.mean().backward(create_graph=True)`` inside ``training_step``."""

    def gradient(self, loss):
        loss.backward(create_graph=True)


class CreateGraphTrainer(AdaHessianTrainer):
    """``self.backward(loss, create_graph=True)``, the Trainer's manual backward (Lightning's ``manual_backward``)."""

    def gradient(self, loss):
        self.backward(loss, create_graph=True)


@pytest.mark.parametrize("port", [CreateGraphTrainer, AdaHessianTrainer, SourceBackwardTrainer])
@pytest.mark.parametrize("check", checks())
def test_adahessian_with_hessian_vector_products_inside_the_step(check, port):
    compare(make_wrn, davda54_hand, port, fixed(cifar()), check, steps=EPOCHS * PER_EPOCH)


class LightningStyleTrainer(AdaHessianTrainer):
    """Lightning's way: automatic mode, its ``backward`` hook overridden to pass ``create_graph=True``."""
    automatic = True

    def training_step(self, batch):
        inputs, labels = batch
        return smooth_crossentropy(self.model(inputs), labels).mean()

    def backward(self, loss, *args, **kwargs):
        loss.backward(create_graph=True)

    def on_step_end(self, losses):
        with torch.no_grad():
            self.scheduler(self.state.epoch)


def test_adahessian_with_lightnings_backward_override_is_refused_at_start_up():
    with pytest.raises(ConfigError, match=r"LightningStyleTrainer.backward overrides the Trainer's own backward: "
                                          r"Trainer.backward is manual mode's self.backward\(loss\): in automatic mode"
                                          r".*set automatic = False and call self.backward\(loss, create_graph=True\)"):
        LightningStyleTrainer(model=make_wrn(), train_data=cifar(), max_steps=2, device="cpu", progress=False,
                              loggers=())


class SavedGeneratorTrainer(AdaHessianTrainer):
    """The optimizer's own generator (an attribute, not in its ``state_dict``) saved with the checkpoint."""

    def on_save_checkpoint(self, checkpoint):
        checkpoint["adahessian"] = {"generator": self.optimizers["optimizer"].generator.get_state()}

    def on_load_checkpoint(self, checkpoint):
        self.optimizers["optimizer"].generator.set_state(checkpoint["adahessian"]["generator"])


@pytest.mark.filterwarnings("error")
def test_adahessian_resumed_midway_with_its_generator_saved(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, make_wrn, SavedGeneratorTrainer, lambda model: cifar(),
                                             EPOCHS * PER_EPOCH, 3)
    assert_same(resumed.model, straight.model)


@pytest.mark.filterwarnings("error")
def test_adahessian_resumed_midway_draws_as_the_straight_run_with_its_generator_saved_by_the_trainer(tmp_path):
    """AdaHessian's ``torch.Generator``, an attribute of the optimizer moved by every step and left out of its
    ``state_dict()``: checkpoints keep its state, so the resumed run draws the same Rademacher vectors."""
    straight, resumed = straight_and_resumed(tmp_path, make_wrn, AdaHessianTrainer, lambda model: cifar(),
                                             EPOCHS * PER_EPOCH, 3)
    assert_same(resumed.model, straight.model)


class LightningSetupTrainer(AdaHessianTrainer):
    """A port that also keeps Lightning's ``setup(self, stage)`` hook (here freezing nothing), as
    ``LIGHTNING_NAMES`` has advice for: it replaces ``Trainer.setup`` itself."""

    def setup(self, stage=None):
        pass


def test_a_port_keeping_lightnings_setup_hook_is_refused_at_start_up():
    with pytest.raises(ConfigError, match=r"LightningSetupTrainer.setup overrides the Trainer's own setup: "
                                          r"Trainer.setup\(\) places the model.*Lightning's setup\(stage\) would "
                                          r"replace it: change the model before fit\(\)"):
        LightningSetupTrainer(model=make_wrn(), train_data=cifar(), max_steps=1, device="cpu", progress=False,
                              loggers=())


# -- amirgholami/adahessian, image_classification/optim_adahessian.py ---------------------------------------------
class Adahessian(torch.optim.Optimizer):
    """Implements Adahessian algorithm.
    It has been proposed in `ADAHESSIAN: An Adaptive Second Order Optimizer for Machine Learning`.
    """

    def __init__(self, params, lr=0.15, betas=(0.9, 0.999), eps=1e-4,
                 weight_decay=0, hessian_power=1, single_gpu=True):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if not 0.0 <= eps:
            raise ValueError("Invalid epsilon value: {}".format(eps))
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(
                "Invalid beta parameter at index 0: {}".format(
                    betas[0]))
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(
                "Invalid beta parameter at index 1: {}".format(
                    betas[1]))
        if not 0.0 <= hessian_power <= 1.0:
            raise ValueError("Invalid Hessian power value: {}".format(hessian_power))
        defaults = dict(lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay, hessian_power=hessian_power)
        self.single_gpu = single_gpu
        super(Adahessian, self).__init__(params, defaults)

    def get_trace(self, params, grads):
        """
        compute the Hessian vector product with a random vector v, at the current gradient point,
        i.e., compute the gradient of <gradsH,v>.
        """

        # Check backward was called with create_graph set to True
        for i, grad in enumerate(grads):
            if grad.grad_fn is None:
                raise RuntimeError('Gradient tensor {:} does not have grad_fn. When calling\n'.format(i) +
                                   '\t\t\t  loss.backward(), make sure the option create_graph is\n' +
                                   '\t\t\t  set to True.')

        v = [2 * torch.randint_like(p, high=2) - 1 for p in params]

        hvs = torch.autograd.grad(
            grads,
            params,
            grad_outputs=v,
            only_inputs=True,
            retain_graph=True)

        hutchinson_trace = []
        for hv in hvs:
            param_size = hv.size()
            if len(param_size) <= 2:  # for 0/1/2D tensor
                # Hessian diagonal block size is 1 here.
                # We use that torch.abs(hv * vi) = hv.abs()
                tmp_output = hv.abs()

            elif len(param_size) == 4:  # Conv kernel
                # Hessian diagonal block size is 9 here: torch.sum() reduces the dim 2/3.
                # We use that torch.abs(hv * vi) = hv.abs()
                tmp_output = torch.mean(hv.abs(), dim=[2, 3], keepdim=True)
            hutchinson_trace.append(tmp_output)

        return hutchinson_trace

    def step(self, closure=None):
        """Performs a single optimization step.
        """
        loss = None
        if closure is not None:
            loss = closure()

        params = []
        groups = []
        grads = []

        # Flatten groups into lists, so that
        #  hut_traces can be called with lists of parameters
        #  and grads
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    params.append(p)
                    groups.append(group)
                    grads.append(p.grad)

        # get the Hessian diagonal

        hut_traces = self.get_trace(params, grads)

        for (p, group, grad, hut_trace) in zip(params, groups, grads, hut_traces):

            state = self.state[p]

            # State initialization
            if len(state) == 0:
                state['step'] = 0
                # Exponential moving average of gradient values
                state['exp_avg'] = torch.zeros_like(p.data)
                # Exponential moving average of Hessian diagonal square values
                state['exp_hessian_diag_sq'] = torch.zeros_like(p.data)

            exp_avg, exp_hessian_diag_sq = state['exp_avg'], state['exp_hessian_diag_sq']

            beta1, beta2 = group['betas']

            state['step'] += 1

            # Decay the first and second moment running average coefficient
            exp_avg.mul_(beta1).add_(grad.detach_(), alpha=1 - beta1)
            exp_hessian_diag_sq.mul_(beta2).addcmul_(hut_trace, hut_trace, value=1 - beta2)

            bias_correction1 = 1 - beta1 ** state['step']
            bias_correction2 = 1 - beta2 ** state['step']

            # make the square root, and the Hessian power
            k = group['hessian_power']
            denom = (
                (exp_hessian_diag_sq.sqrt() ** k) /
                math.sqrt(bias_correction2) ** k).add_(
                group['eps'])

            # make update
            p.data = p.data - \
                group['lr'] * (exp_avg / bias_correction1 / denom + group['weight_decay'] * p.data)

        return loss


# -- image_classification/main.py ---------------------------------------------------------------------------------
A_EPOCHS, A_LR, A_WD, A_DECAY_EPOCHS, A_DECAY = 3, 0.15, 5e-4, [2], 0.1


def make_mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def authors_optimizer(model):
    weight_decay = A_WD / A_LR  # "we use the decoupled weight decay as AdamW": main.py corrects it so
    return Adahessian(model.parameters(), lr=A_LR, weight_decay=weight_decay)


def authors_hand(model, train_loader):
    criterion = nn.CrossEntropyLoss()
    optimizer = authors_optimizer(model)
    scheduler = lr_scheduler.MultiStepLR(optimizer, A_DECAY_EPOCHS, gamma=A_DECAY, last_epoch=-1)
    for epoch in range(1, A_EPOCHS + 1):
        train_loss = 0.
        total_num = 0
        correct = 0

        scheduler.step()
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            output = model(data)
            loss = criterion(output, target)
            loss.backward(create_graph=True)
            train_loss += loss.item() * target.size()[0]
            total_num += target.size()[0]
            _, predicted = output.max(1)
            correct += predicted.eq(target).sum().item()
            optimizer.step()
            optimizer.zero_grad()


class AuthorsTrainer(Trainer):
    """The source's ``backward(create_graph=True)`` in manual mode; its ``MultiStepLR`` stepped at each epoch's
    start, as ``main.py`` steps it (before any update: PyTorch's order warning, which the hand loop gives too)."""
    automatic = False

    def configure_optimizers(self):
        optimizer = authors_optimizer(self.model)
        self.scheduler = lr_scheduler.MultiStepLR(optimizer, A_DECAY_EPOCHS, gamma=A_DECAY, last_epoch=-1)
        return optimizer

    def on_epoch_start(self):
        self.scheduler.step()

    def training_step(self, batch):
        data, target = batch
        loss = nn.CrossEntropyLoss()(self.model(data), target)
        loss.backward(create_graph=True)
        self.step()
        return loss


@pytest.mark.parametrize("check", checks())
def test_authors_adahessian_detaching_the_gradients_in_place(check):
    gen = torch.Generator().manual_seed(6)
    data = [(torch.randn(8, 4, generator=gen), torch.randint(3, (8,), generator=gen)) for _ in range(2)]
    compare(make_mlp, authors_hand, AuthorsTrainer, fixed(data), check, steps=A_EPOCHS * len(data))
