"""Max-norm weight constraints as EEG decoding applies them: braindecode/braindecode at commit
308972626d9f202e1a6eaa06f243156a26ae4ff7 (2019-05-22, before ``torch_ext`` and ``experiments`` were
removed): braindecode/experiments/experiment.py (``Experiment.train_batch``), braindecode/torch_ext/
constraints.py (``MaxNormDefaultConstraint``), braindecode/models/shallow_fbcsp.py (``ShallowFBCSPNet``),
braindecode/models/eegnet.py (``Conv2dWithConstraint``, ``EEGNetv4``), braindecode/torch_ext/{modules,
functions,init}.py (``Expression``, ``square``, ``safe_log``, ``glorot_weight_zero_bias``) and
examples/bcic_iv_2a.py (``run_exp``: Adam with its defaults, ``F.nll_loss``, ``MaxNormDefaultConstraint``).

Two ways of holding a weight's rows under a norm, both through ``.data``, both correct:

- ``MaxNormDefaultConstraint.apply(model)`` after every ``optimizer.step()``: every child with a ``weight``
  (BatchNorm excepted) gets ``weight.data = th.renorm(weight.data, 2, 0, maxnorm=2)``, the last one
  ``maxnorm=0.5`` on top; new storage for parameters Adam holds, outside the step.
- ``Conv2dWithConstraint.forward`` (EEGNetv4's spatial convolution) does the same to its own weight at the
  start of every forward, inside the step, before the convolution reads (and saves) it; ``create_network``
  runs a mock forward in train mode to size the classifier, which renorms once and moves BatchNorm's
  statistics before training.

Changes for a seconds-long test: 3 channels of 24 samples, 4 filters, short kernels and pools; the
example's data set, ``BalancedBatchSizeIterator`` (which gives (batch, chans, time, 1) arrays), monitors
and early stopping are replaced by fixed seeded batches of that shape; no CUDA. ``EEGNetv4`` is run
through the same ``run_exp`` (the example offers shallow and deep nets; the loop and constraint are
the same whatever the net). In ``train_batch`` the source's ``np_to_var`` of NumPy arrays is left out:
the batches are tensors already.
"""
import numpy as np
import pytest
import torch
import torch as th
import torch.nn.functional as F
from torch import nn, optim
from torch.nn import init
from torch.nn.functional import elu

from safeloop import Trainer

from .harness import checks, compare, fixed

CHANS, TIME, CLASSES, BATCH, STEPS = 3, 24, 4, 6, 6  # the example's BCI IV 2a has 4 classes


# -- braindecode/torch_ext/util.py, modules.py, functions.py, init.py -----------------------------------
def np_to_var(X, requires_grad=False, dtype=None, pin_memory=False, **tensor_kwargs):
    if not hasattr(X, "__len__"):
        X = [X]
    X = np.asarray(X)
    if dtype is not None:
        X = X.astype(dtype)
    X_tensor = th.tensor(X, requires_grad=requires_grad, **tensor_kwargs)
    if pin_memory:
        X_tensor = X_tensor.pin_memory()
    return X_tensor


class Expression(torch.nn.Module):
    def __init__(self, expression_fn):
        super(Expression, self).__init__()
        self.expression_fn = expression_fn

    def forward(self, *x):
        return self.expression_fn(*x)


def square(x):
    return x * x


def safe_log(x, eps=1e-6):
    """ Prevents :math:`log(0)` by using :math:`log(max(x, eps))`."""
    return th.log(th.clamp(x, min=eps))


def glorot_weight_zero_bias(model):
    for module in model.modules():
        if hasattr(module, "weight"):
            if not ("BatchNorm" in module.__class__.__name__):
                init.xavier_uniform_(module.weight, gain=1)
            else:
                init.constant_(module.weight, 1)
        if hasattr(module, "bias"):
            if module.bias is not None:
                init.constant_(module.bias, 0)


# -- braindecode/torch_ext/constraints.py ------------------------------------------------------------------
class MaxNormDefaultConstraint(object):
    def apply(self, model):
        last_weight = None
        for name, module in list(model.named_children()):
            if hasattr(module, "weight") and (
                not module.__class__.__name__.startswith("BatchNorm")
            ):
                module.weight.data = th.renorm(
                    module.weight.data, 2, 0, maxnorm=2
                )
                last_weight = module.weight
        if last_weight is not None:
            last_weight.data = th.renorm(last_weight.data, 2, 0, maxnorm=0.5)


# -- braindecode/models/shallow_fbcsp.py (BaseModel's create_network is what run_exp calls) ---------------
class ShallowFBCSPNet(object):
    def __init__(self, in_chans, n_classes, input_time_length=None, n_filters_time=40, filter_time_length=25,
                 n_filters_spat=40, pool_time_length=75, pool_time_stride=15, final_conv_length=30,
                 conv_nonlin=square, pool_mode="mean", pool_nonlin=safe_log, split_first_layer=True,
                 batch_norm=True, batch_norm_alpha=0.1, drop_prob=0.5):
        if final_conv_length == "auto":
            assert input_time_length is not None
        self.__dict__.update(locals())
        del self.self

    def create_network(self):
        pool_class = dict(max=nn.MaxPool2d, mean=nn.AvgPool2d)[self.pool_mode]
        model = nn.Sequential()
        if self.split_first_layer:
            model.add_module("dimshuffle", Expression(_transpose_time_to_spat))
            model.add_module("conv_time", nn.Conv2d(1, self.n_filters_time, (self.filter_time_length, 1), stride=1))
            model.add_module("conv_spat", nn.Conv2d(self.n_filters_time, self.n_filters_spat, (1, self.in_chans),
                                                    stride=1, bias=not self.batch_norm))
            n_filters_conv = self.n_filters_spat
        else:
            model.add_module("conv_time", nn.Conv2d(self.in_chans, self.n_filters_time,
                                                    (self.filter_time_length, 1), stride=1,
                                                    bias=not self.batch_norm))
            n_filters_conv = self.n_filters_time
        if self.batch_norm:
            model.add_module("bnorm", nn.BatchNorm2d(n_filters_conv, momentum=self.batch_norm_alpha, affine=True))
        model.add_module("conv_nonlin", Expression(self.conv_nonlin))
        model.add_module("pool", pool_class(kernel_size=(self.pool_time_length, 1),
                                            stride=(self.pool_time_stride, 1)))
        model.add_module("pool_nonlin", Expression(self.pool_nonlin))
        model.add_module("drop", nn.Dropout(p=self.drop_prob))
        model.eval()
        if self.final_conv_length == "auto":
            out = model(np_to_var(np.ones((1, self.in_chans, self.input_time_length, 1), dtype=np.float32)))
            n_out_time = out.cpu().data.numpy().shape[2]
            self.final_conv_length = n_out_time
        model.add_module("conv_classifier", nn.Conv2d(n_filters_conv, self.n_classes, (self.final_conv_length, 1),
                                                      bias=True))
        model.add_module("softmax", nn.LogSoftmax(dim=1))
        model.add_module("squeeze", Expression(_squeeze_final_output))

        # Initialization, xavier is same as in paper...
        init.xavier_uniform_(model.conv_time.weight, gain=1)
        # maybe no bias in case of no split layer and batch norm
        if self.split_first_layer or (not self.batch_norm):
            init.constant_(model.conv_time.bias, 0)
        if self.split_first_layer:
            init.xavier_uniform_(model.conv_spat.weight, gain=1)
            if not self.batch_norm:
                init.constant_(model.conv_spat.bias, 0)
        if self.batch_norm:
            init.constant_(model.bnorm.weight, 1)
            init.constant_(model.bnorm.bias, 0)
        init.xavier_uniform_(model.conv_classifier.weight, gain=1)
        init.constant_(model.conv_classifier.bias, 0)

        return model


def _squeeze_final_output(x):
    assert x.size()[3] == 1
    x = x[:, :, :, 0]
    if x.size()[2] == 1:
        x = x[:, :, 0]
    return x


def _transpose_time_to_spat(x):
    return x.permute(0, 3, 2, 1)


# -- braindecode/models/eegnet.py ----------------------------------------------------------------------------
class Conv2dWithConstraint(nn.Conv2d):
    def __init__(self, *args, max_norm=1, **kwargs):
        self.max_norm = max_norm
        super(Conv2dWithConstraint, self).__init__(*args, **kwargs)

    def forward(self, x):
        self.weight.data = th.renorm(
            self.weight.data, p=2, dim=0, maxnorm=self.max_norm
        )
        return super(Conv2dWithConstraint, self).forward(x)


class EEGNetv4(object):
    def __init__(self, in_chans, n_classes, final_conv_length="auto", input_time_length=None, pool_mode="mean",
                 F1=8, D=2, F2=16, kernel_length=64, third_kernel_size=(8, 4), drop_prob=0.25):
        if final_conv_length == "auto":
            assert input_time_length is not None
        self.__dict__.update(locals())
        del self.self

    def create_network(self):
        """The source's, with its pools (1, 4) and (1, 8) and its separable kernel (1, 16) shrunk to (1, 2),
        (1, 2) and (1, 4) for 24 samples."""
        pool_class = dict(max=nn.MaxPool2d, mean=nn.AvgPool2d)[self.pool_mode]
        model = nn.Sequential()
        # b c 0 1
        # now to b 1 0 c
        model.add_module("dimshuffle", Expression(_transpose_to_b_1_c_0))
        model.add_module("conv_temporal", nn.Conv2d(1, self.F1, (1, self.kernel_length), stride=1, bias=False,
                                                    padding=(0, self.kernel_length // 2)))
        model.add_module("bnorm_temporal", nn.BatchNorm2d(self.F1, momentum=0.01, affine=True, eps=1e-3))
        model.add_module("conv_spatial", Conv2dWithConstraint(self.F1, self.F1 * self.D, (self.in_chans, 1),
                                                              max_norm=1, stride=1, bias=False, groups=self.F1,
                                                              padding=(0, 0)))
        model.add_module("bnorm_1", nn.BatchNorm2d(self.F1 * self.D, momentum=0.01, affine=True, eps=1e-3))
        model.add_module("elu_1", Expression(elu))
        model.add_module("pool_1", pool_class(kernel_size=(1, 2), stride=(1, 2)))
        model.add_module("drop_1", nn.Dropout(p=self.drop_prob))
        model.add_module("conv_separable_depth", nn.Conv2d(self.F1 * self.D, self.F1 * self.D, (1, 4), stride=1,
                                                           bias=False, groups=self.F1 * self.D,
                                                           padding=(0, 4 // 2)))
        model.add_module("conv_separable_point", nn.Conv2d(self.F1 * self.D, self.F2, (1, 1), stride=1,
                                                           bias=False, padding=(0, 0)))
        model.add_module("bnorm_2", nn.BatchNorm2d(self.F2, momentum=0.01, affine=True, eps=1e-3))
        model.add_module("elu_2", Expression(elu))
        model.add_module("pool_2", pool_class(kernel_size=(1, 2), stride=(1, 2)))
        model.add_module("drop_2", nn.Dropout(p=self.drop_prob))

        out = model(np_to_var(np.ones((1, self.in_chans, self.input_time_length, 1), dtype=np.float32)))
        n_out_virtual_chans = out.cpu().data.numpy().shape[2]

        if self.final_conv_length == "auto":
            n_out_time = out.cpu().data.numpy().shape[3]
            self.final_conv_length = n_out_time

        model.add_module("conv_classifier", nn.Conv2d(self.F2, self.n_classes,
                                                      (n_out_virtual_chans, self.final_conv_length), bias=True))
        model.add_module("softmax", nn.LogSoftmax(dim=1))  # the source's LogSoftmax() (an implicit dim: 1 here)
        # Transpose back to the the logic of braindecode,
        # so time in third dimension (axis=2)
        model.add_module("permute_back", Expression(_transpose_1_0))
        model.add_module("squeeze", Expression(_squeeze_final_output))

        glorot_weight_zero_bias(model)
        return model


def _transpose_to_b_1_c_0(x):
    return x.permute(0, 3, 1, 2)


def _transpose_1_0(x):
    return x.permute(0, 1, 3, 2)


# -- examples/bcic_iv_2a.py (run_exp) and experiments/experiment.py (train_batch) ----------------------------
def shallow():
    return ShallowFBCSPNet(CHANS, CLASSES, input_time_length=TIME, final_conv_length="auto", n_filters_time=4,
                           filter_time_length=5, n_filters_spat=4, pool_time_length=6,
                           pool_time_stride=3).create_network()


def eegnet():
    """Glorot's init leaves the spatial filters' rows under the bound of 1 (the renorm bites as training grows
    them): they are scaled up here, as a trained net's would be, so that the renorm in forward changes them."""
    model = EEGNetv4(CHANS, CLASSES, input_time_length=TIME, F1=4, D=2, F2=8, kernel_length=8).create_network()
    with torch.no_grad():
        model.conv_spatial.weight.mul_(4)
    return model


def train_batch(model, optimizer, loss_function, model_constraint, input_vars, target_vars):
    """Experiment.train_batch, ``self.`` attributes passed in (``model_loss_function`` is None in run_exp)."""
    model.train()
    optimizer.zero_grad()
    outputs = model(input_vars)
    loss = loss_function(outputs, target_vars)
    loss.backward()
    optimizer.step()
    if model_constraint is not None:
        model_constraint.apply(model)


def eeg_hand(model, data):
    optimizer = optim.Adam(model.parameters())
    model_constraint = MaxNormDefaultConstraint()
    for inputs, targets in data:
        train_batch(model, optimizer, F.nll_loss, model_constraint, inputs, targets)


class MaxNorm(Trainer):
    """The constraint follows every update, in on_step_end. ``training_step`` calls ``model.train()`` as
    ``train_batch`` does: the Trainer leaves the model in the mode it was given, and ``ShallowFBCSPNet``'s
    ``create_network`` returns it in eval mode (no dropout, BatchNorm on its running statistics)."""

    def configure_optimizers(self):
        self.model_constraint = MaxNormDefaultConstraint()
        return optim.Adam(self.model.parameters())

    def training_step(self, batch):
        self.model.train()
        inputs, targets = batch
        return F.nll_loss(self.model(inputs), targets)

    def on_step_end(self, losses):
        self.model_constraint.apply(self.model)


def trials(n=STEPS):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, CHANS, TIME, 1, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(n)]


@pytest.mark.parametrize("check", checks())
def test_shallow_convnet_with_a_max_norm_constraint_after_each_step(check):
    compare(shallow, eeg_hand, MaxNorm, fixed(trials()), check, steps=STEPS)


@pytest.mark.parametrize("check", checks())
def test_eegnet_with_a_max_norm_renorm_in_forward(check):
    compare(eegnet, eeg_hand, MaxNorm, fixed(trials()), check, steps=STEPS)


@pytest.mark.parametrize("make", [shallow, eegnet])
def test_the_constraints_bite(make):
    """The sizes leave rows above the bounds: the renorms change weights (else the cases prove little)."""
    torch.manual_seed(0)
    model = make()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    MaxNormDefaultConstraint().apply(model)
    assert not torch.equal(model.conv_classifier.weight, before["conv_classifier.weight"])
    if make is eegnet:
        before = model.conv_spatial.weight.detach().clone()
        model(trials(1)[0][0])
        assert not torch.equal(model.conv_spatial.weight, before)
