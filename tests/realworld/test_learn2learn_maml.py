"""Second-order MAML as learn2learn writes it: learnables/learn2learn at commit
db5cee3795490071282bbdfa81179ef732349196, examples/vision/maml_omniglot.py (``fast_adapt``, ``main``),
learn2learn/algorithms/maml.py (``maml_update``, ``MAML``), learn2learn/algorithms/base_learner.py
(``BaseLearner``), learn2learn/utils/__init__.py (``clone_module``, ``update_module``),
learn2learn/vision/models/cnn4.py (``LinearBlock``, ``OmniglotFC``, ``fc_init_``) and learn2learn/nn/misc.py
(``Flatten``).

- ``maml.clone()`` copies the module object by object (``__new__``, ``__dict__.copy()``) and replaces every
  parameter with ``param.clone()``: the learner's "parameters" are non-leaf tensors in ``_parameters``, whose
  graph leads back to the meta-parameters.
- ``learner.adapt(loss)`` takes ``torch.autograd.grad(loss, params, retain_graph=True, create_graph=True)``
  and ``update_module`` writes ``p + (-lr * g)`` back into ``_parameters``, module by module, through a memo.
- Per task, the adapted learner's evaluation loss is back-propagated into the meta-parameters at once
  (``evaluation_error.backward()``: gradients accumulate over the meta-batch); a second clone adapted on a
  validation task is only evaluated (its graph dropped); then every ``p.grad.data`` is scaled by
  ``1 / meta_batch_size`` in place and Adam steps.
- BatchNorm1d without running statistics (``track_running_stats=False``) in every block, batch statistics
  in the adaptation and the evaluation alike.

Changes for a seconds-long test: 4x4 single-channel "characters" (28x28), hidden layers of 8 and 8 (256, 128,
64, 64), 3 ways (5), a meta-batch of 2 (32), 3 iterations (60000); random tasks in place of Omniglot's
(``tasksets.train.sample()``: the adaptation/evaluation split by even and odd indices is the source's);
scipy's ``truncnorm`` (not installed here) in ``fc_init_`` is ``torch.nn.init.trunc_normal_`` at two
standard deviations; no CUDA; the prints and the meta-test are left out. ``adaptation_steps`` is the
example's 1 and, in a second case, 2 (``fast_adapt``'s loop, as other learn2learn examples set it): under
``watch``, before the first optimizer step, each adaptation's ``torch.autograd.grad`` begins a step of its
own, and the second one goes through the first one's graph.

The port is manual: each task's ``self.backward(evaluation_error)``, the scaling, ``self.step()``.
"""
import numpy as np
import pytest
import torch
from torch import nn, optim
from torch.autograd import grad

from safeloop import Trainer

from .harness import checks, compare

WAYS, SHOTS, META_LR, FAST_LR, META_BATCH, ITERATIONS, SIDE = 3, 1, 0.003, 0.5, 2, 3, 4


# -- learn2learn/utils/__init__.py ------------------------------------------------------------------------
def clone_module(module, memo=None):
    if memo is None:
        # Maps original data_ptr to the cloned tensor.
        # Useful when a Module uses parameters from another Module; see:
        # https://github.com/learnables/learn2learn/issues/174
        memo = {}

    # First, create a copy of the module.
    if not isinstance(module, torch.nn.Module):
        return module
    clone = module.__new__(type(module))
    clone.__dict__ = module.__dict__.copy()
    clone._parameters = clone._parameters.copy()
    clone._buffers = clone._buffers.copy()
    clone._modules = clone._modules.copy()

    # Second, re-write all parameters
    if hasattr(clone, '_parameters'):
        for param_key in module._parameters:
            if module._parameters[param_key] is not None:
                param = module._parameters[param_key]
                param_ptr = param.data_ptr
                if param_ptr in memo:
                    clone._parameters[param_key] = memo[param_ptr]
                else:
                    cloned = param.clone()
                    clone._parameters[param_key] = cloned
                    memo[param_ptr] = cloned

    # Third, handle the buffers if necessary
    if hasattr(clone, '_buffers'):
        for buffer_key in module._buffers:
            if clone._buffers[buffer_key] is not None and \
                    clone._buffers[buffer_key].requires_grad:
                buff = module._buffers[buffer_key]
                buff_ptr = buff.data_ptr
                if buff_ptr in memo:
                    clone._buffers[buffer_key] = memo[buff_ptr]
                else:
                    cloned = buff.clone()
                    clone._buffers[buffer_key] = cloned
                    memo[buff_ptr] = cloned

    # Then, recurse for each submodule
    if hasattr(clone, '_modules'):
        for module_key in clone._modules:
            clone._modules[module_key] = clone_module(
                module._modules[module_key],
                memo=memo,
            )

    # Finally, rebuild the flattened parameters for RNNs
    # See this issue for more details:
    # https://github.com/learnables/learn2learn/issues/139
    if hasattr(clone, 'flatten_parameters'):
        clone = clone._apply(lambda x: x)
    return clone


def update_module(module, updates=None, memo=None):
    if memo is None:
        memo = {}
    if updates is not None:
        params = list(module.parameters())
        if not len(updates) == len(list(params)):
            msg = 'WARNING:update_module(): Parameters and updates have different length. ('
            msg += str(len(params)) + ' vs ' + str(len(updates)) + ')'
            print(msg)
        for p, g in zip(params, updates):
            p.update = g

    # Update the params
    for param_key in module._parameters:
        p = module._parameters[param_key]
        if p in memo:
            module._parameters[param_key] = memo[p]
        else:
            if p is not None and hasattr(p, 'update') and p.update is not None:
                updated = p + p.update
                p.update = None
                memo[p] = updated
                module._parameters[param_key] = updated

    # Second, handle the buffers if necessary
    for buffer_key in module._buffers:
        buff = module._buffers[buffer_key]
        if buff in memo:
            module._buffers[buffer_key] = memo[buff]
        else:
            if buff is not None and hasattr(buff, 'update') and buff.update is not None:
                updated = buff + buff.update
                buff.update = None
                memo[buff] = updated
                module._buffers[buffer_key] = updated

    # Then, recurse for each submodule
    for module_key in module._modules:
        module._modules[module_key] = update_module(
            module._modules[module_key],
            updates=None,
            memo=memo,
        )

    # Finally, rebuild the flattened parameters for RNNs
    # See this issue for more details:
    # https://github.com/learnables/learn2learn/issues/139
    if hasattr(module, 'flatten_parameters'):
        module._apply(lambda x: x)
    return module


# -- learn2learn/algorithms ---------------------------------------------------------------------------------
class BaseLearner(nn.Module):

    def __init__(self, module=None):
        super(BaseLearner, self).__init__()
        self.module = module

    def __getattr__(self, attr):
        try:
            return super(BaseLearner, self).__getattr__(attr)
        except AttributeError:
            return getattr(self.__dict__['_modules']['module'], attr)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def maml_update(model, lr, grads=None):
    if grads is not None:
        params = list(model.parameters())
        if not len(grads) == len(list(params)):
            msg = 'WARNING:maml_update(): Parameters and gradients have different length. ('
            msg += str(len(params)) + ' vs ' + str(len(grads)) + ')'
            print(msg)
        for p, g in zip(params, grads):
            if g is not None:
                p.update = - lr * g
    return update_module(model)


class MAML(BaseLearner):
    """The source's, without its ``allow_nograd`` branch (off by default)."""

    def __init__(self, model, lr, first_order=False, allow_unused=None, allow_nograd=False):
        super(MAML, self).__init__()
        self.module = model
        self.lr = lr
        self.first_order = first_order
        self.allow_nograd = allow_nograd
        if allow_unused is None:
            allow_unused = allow_nograd
        self.allow_unused = allow_unused

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def adapt(self, loss, first_order=None, allow_unused=None, allow_nograd=None):
        if first_order is None:
            first_order = self.first_order
        if allow_unused is None:
            allow_unused = self.allow_unused
        if allow_nograd is None:
            allow_nograd = self.allow_nograd
        second_order = not first_order
        assert not allow_nograd
        gradients = grad(loss,
                         self.module.parameters(),
                         retain_graph=second_order,
                         create_graph=second_order,
                         allow_unused=allow_unused)

        # Update the module
        self.module = maml_update(self.module, self.lr, gradients)

    def clone(self, first_order=None, allow_unused=None, allow_nograd=None):
        if first_order is None:
            first_order = self.first_order
        if allow_unused is None:
            allow_unused = self.allow_unused
        if allow_nograd is None:
            allow_nograd = self.allow_nograd
        return MAML(clone_module(self.module),
                    lr=self.lr,
                    first_order=first_order,
                    allow_unused=allow_unused,
                    allow_nograd=allow_nograd)


# -- learn2learn/vision/models/cnn4.py, learn2learn/nn/misc.py ----------------------------------------------
class Flatten(torch.nn.Module):
    def forward(self, x):
        return x.view(x.size(0), -1)


def fc_init_(module):
    if hasattr(module, 'weight') and module.weight is not None:
        torch.nn.init.trunc_normal_(module.weight.data, mean=0.0, std=0.01, a=-0.02, b=0.02)  # truncnorm(-2, 2)
    if hasattr(module, 'bias') and module.bias is not None:
        torch.nn.init.constant_(module.bias.data, 0.0)
    return module


class LinearBlock(torch.nn.Module):

    def __init__(self, input_size, output_size):
        super(LinearBlock, self).__init__()
        self.relu = torch.nn.ReLU()
        self.normalize = torch.nn.BatchNorm1d(
            output_size,
            affine=True,
            momentum=0.999,
            eps=1e-3,
            track_running_stats=False,
        )
        self.linear = torch.nn.Linear(input_size, output_size)
        fc_init_(self.linear)

    def forward(self, x):
        x = self.linear(x)
        x = self.normalize(x)
        x = self.relu(x)
        return x


class OmniglotFC(torch.nn.Module):

    def __init__(self, input_size, output_size, sizes=None):
        super(OmniglotFC, self).__init__()
        if sizes is None:
            sizes = [256, 128, 64, 64]
        layers = [LinearBlock(input_size, sizes[0]), ]
        for s_i, s_o in zip(sizes[:-1], sizes[1:]):
            layers.append(LinearBlock(s_i, s_o))
        layers = torch.nn.Sequential(*layers)
        self.features = torch.nn.Sequential(
            Flatten(),
            layers,
        )
        self.classifier = fc_init_(torch.nn.Linear(sizes[-1], output_size))
        self.input_size = input_size

    def forward(self, x):
        x = self.features(x)
        x = self.classifier(x)
        return x


# -- examples/vision/maml_omniglot.py -----------------------------------------------------------------------
def accuracy(predictions, targets):
    predictions = predictions.argmax(dim=1).view(targets.shape)
    return (predictions == targets).sum().float() / targets.size(0)


def fast_adapt(batch, learner, loss, adaptation_steps, shots, ways, device):
    data, labels = batch
    data, labels = data.to(device), labels.to(device)

    # Separate data into adaptation/evalutation sets
    adaptation_indices = np.zeros(data.size(0), dtype=bool)
    adaptation_indices[np.arange(shots * ways) * 2] = True
    evaluation_indices = torch.from_numpy(~adaptation_indices)
    adaptation_indices = torch.from_numpy(adaptation_indices)
    adaptation_data, adaptation_labels = data[adaptation_indices], labels[adaptation_indices]
    evaluation_data, evaluation_labels = data[evaluation_indices], labels[evaluation_indices]

    # Adapt the model
    for step in range(adaptation_steps):
        train_error = loss(learner(adaptation_data), adaptation_labels)
        learner.adapt(train_error)

    # Evaluate the adapted model
    predictions = learner(evaluation_data)
    valid_error = loss(predictions, evaluation_labels)
    valid_accuracy = accuracy(predictions, evaluation_labels)
    return valid_error, valid_accuracy


def make_maml():
    model = OmniglotFC(SIDE ** 2, WAYS, sizes=[8, 8])  # (28 ** 2, ways), sizes [256, 128, 64, 64]
    return MAML(model, lr=FAST_LR, first_order=False)


loss = nn.CrossEntropyLoss(reduction='mean')
device = torch.device('cpu')


def meta_batch(maml, tasks, adaptation_steps, backward):
    """``main``'s loop over the meta-batch: each task's meta-training loss back-propagated by ``backward``, a
    validation task adapted and evaluated."""
    for task in range(META_BATCH):
        # Compute meta-training loss
        learner = maml.clone()
        batch = tasks.train.pop(0)
        evaluation_error, evaluation_accuracy = fast_adapt(batch, learner, loss, adaptation_steps, SHOTS, WAYS,
                                                           device)
        backward(evaluation_error)

        # Compute meta-validation loss
        learner = maml.clone()
        batch = tasks.validation.pop(0)
        evaluation_error, evaluation_accuracy = fast_adapt(batch, learner, loss, adaptation_steps, SHOTS, WAYS,
                                                           device)
    # Average the accumulated gradients and optimize
    for p in maml.parameters():
        p.grad.data.mul_(1.0 / META_BATCH)


def maml_hand(maml, tasks):
    opt = optim.Adam(maml.parameters(), META_LR)
    for iteration in range(ITERATIONS):
        opt.zero_grad()
        meta_batch(maml, tasks, tasks.adaptation_steps, lambda error: error.backward())
        opt.step()


class L2LMAML(Trainer):
    automatic = False

    def configure_optimizers(self):
        return optim.Adam(self.model.parameters(), META_LR)

    def training_step(self, batch):
        meta_batch(self.model, self.train_data, self.train_data.adaptation_steps, self.backward)
        self.step()


class Tasks:
    """``tasksets``: 2 * shots samples of each of ``ways`` classes per task, labels 0..ways-1 in pairs (the
    even indices adapt, the odd evaluate); iterated, one (unused) batch per iteration."""

    def __init__(self, adaptation_steps):
        self.adaptation_steps = adaptation_steps
        gen = torch.Generator().manual_seed(19)

        def task():
            labels = torch.arange(WAYS).repeat_interleave(2 * SHOTS)
            return torch.randn(2 * SHOTS * WAYS, 1, SIDE, SIDE, generator=gen) + labels.view(-1, 1, 1, 1), labels
        self.train = [task() for _ in range(ITERATIONS * META_BATCH)]
        self.validation = [task() for _ in range(ITERATIONS * META_BATCH)]

    def __iter__(self):
        return iter(range(ITERATIONS))


@pytest.mark.parametrize("check", checks())
def test_learn2learn_maml_with_one_adaptation_step(check):
    compare(make_maml, maml_hand, L2LMAML, lambda model: Tasks(1), check, steps=ITERATIONS)


@pytest.mark.parametrize("check", checks())
def test_learn2learn_maml_with_two_adaptation_steps(check):
    compare(make_maml, maml_hand, L2LMAML, lambda model: Tasks(2), check, steps=ITERATIONS)
