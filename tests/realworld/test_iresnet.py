"""Invertible residual networks trained for density estimation: jhjacobsen/invertible-resnet at commit
630e886bcd50cc21dee0769d1a5b35100d3ff569, models/conv_iResNet.py (``conv_iresnet_block``, ``conv_iResNet``),
matrix_utils.py (``power_series_matrix_logarithm_trace``), models/model_utils.py (``injective_pad``,
``squeeze``, ``ActNorm2D``), spectral_norm_conv_inplace.py and spectral_norm_fc.py (``SpectralNormConv``,
``SpectralNorm``), models/utils_cifar.py (``train``, ``bits_per_dim``, ``update_lr``) and CIFAR_main.py
(``get_init_batch``, the actnorm initialization, the optimizer, the epochs), with ``-densityEstimation``.

- Every block's forward estimates the log-determinant of its Jacobian by a power series of vector-Jacobian
  products: ``torch.autograd.grad(Fx, x, grad_outputs=..., retain_graph=True, create_graph=True)`` in a loop,
  inside the model's forward, with a Hutchinson probe drawn from ``torch.randn``; the training loss
  back-propagates through those gradients (second order). The inputs are made to require grad
  (``Variable(inputs, requires_grad=True)``).
- The blocks' convolutions are spectrally normalized by forward pre-hooks that run power iterations under
  ``no_grad`` into ``u``/``v`` buffers written in place (``normalize(..., out=v)``), log ``sigma`` into a
  buffer with ``copy_``, and set the layer's ``weight`` attribute to ``weight_orig`` divided by the bound.
- ActNorm initializes its parameters from the data through ``.data`` on its first forward, a
  ``no_grad`` forward of an initialization batch before training; a learned Gaussian prior; the traces
  summed in place (``tmp_trace += traces[k]``); bits per dimension as the loss; Adamax; a learning-rate
  warmup assigning ``param_group['lr']``.

Changes for a seconds-long test: 8x8 images (CIFAR-10's 32x32), two blocks (``--nBlocks 1 1 --nStrides 1 2
--nChannels 8 8``; the script's 16 16 16 and 512), 2 epochs of 3 batches of 4 with a warmup of 1 epoch (as
the script), an initialization batch of 8 (1024), random images in place of CIFAR-10 and its
augmentations; the single-scale ``conv_iResNet`` (``-multiScale`` off), its classification head and
``inverse``/``sample`` left out, as are the loaders' shuffling, the visdom plots, logs, checkpoints and tests;
``np.float(j)`` (removed from NumPy) is ``float(j)``; the spectral norms' state-dict hooks (for loading old
checkpoints) are left out.
"""
import copy

import numpy as np
import pytest
import torch
import torch.distributions as distributions
import torch.nn as nn
import torch.optim as optim
from torch.autograd import Variable
from torch.nn.functional import conv2d, conv_transpose2d, normalize
from torch.nn.parameter import Parameter

from safeloop import Trainer

from .harness import assert_same, checks, compare

IN_SHAPE, BATCH, PER_EPOCH, INIT_BATCH = (3, 8, 8), 4, 3, 8
args = type("args", (), dict(nBlocks=[1, 1], nStrides=[1, 2], nChannels=[8, 8], coeff=0.9, numTraceSamples=1,
                             numSeriesTerms=5, powerIterSpectralNorm=5, init_ds=2, inj_pad=0, lr=0.003,
                             weight_decay=0., warmup_epochs=1, epochs=2, nonlin="elu", densityEstimation=True))


# -- matrix_utils.py --------------------------------------------------------------------------------------
def power_series_matrix_logarithm_trace(Fx, x, k, n):
    # trace estimation including power series
    outSum = Fx.sum(dim=0)
    dim = list(outSum.shape)
    dim.insert(0, n)
    dim.insert(0, x.size(0))
    u = torch.randn(dim).to(x.device)
    trLn = 0
    for j in range(1, k + 1):
        if j == 1:
            vectors = u
        # compute vector-jacobian product
        vectors = [torch.autograd.grad(Fx, x, grad_outputs=vectors[:, i],
                                       retain_graph=True, create_graph=True)[0] for i in range(n)]
        # compute summand
        vectors = torch.stack(vectors, dim=1)
        vjp4D = vectors.view(x.size(0), n, 1, -1)
        u4D = u.view(x.size(0), n, -1, 1)
        summand = torch.matmul(vjp4D, u4D)
        # add summand to power series
        if (j + 1) % 2 == 0:
            trLn += summand / float(j)
        else:
            trLn -= summand / float(j)
    trace = trLn.mean(dim=1).squeeze()
    return trace


# -- spectral_norm_fc.py, spectral_norm_conv_inplace.py ---------------------------------------------------
class SpectralNorm(object):
    def __init__(self, coeff, name='weight', n_power_iterations=1, dim=0, eps=1e-12):
        self.coeff = coeff
        self.name = name
        self.dim = dim
        self.n_power_iterations = n_power_iterations
        self.eps = eps

    def reshape_weight_to_matrix(self, weight):
        weight_mat = weight
        if self.dim != 0:
            weight_mat = weight_mat.permute(self.dim, *[d for d in range(weight_mat.dim()) if d != self.dim])
        height = weight_mat.size(0)
        return weight_mat.reshape(height, -1)

    def compute_weight(self, module, do_power_iteration):
        weight = getattr(module, self.name + '_orig')
        u = getattr(module, self.name + '_u')
        v = getattr(module, self.name + '_v')
        sigma_log = getattr(module, self.name + '_sigma')  # for logging
        weight_mat = self.reshape_weight_to_matrix(weight)

        if do_power_iteration:
            with torch.no_grad():
                for _ in range(self.n_power_iterations):
                    v = normalize(torch.mv(weight_mat.t(), u), dim=0, eps=self.eps, out=v)
                    u = normalize(torch.mv(weight_mat, v), dim=0, eps=self.eps, out=u)
                if self.n_power_iterations > 0:
                    u = u.clone()
                    v = v.clone()

        sigma = torch.dot(u, torch.mv(weight_mat, v))
        factor = torch.max(torch.ones(1).to(weight.device), sigma / self.coeff)
        weight = weight / factor

        sigma_log.copy_(sigma.detach())

        return weight

    def __call__(self, module, inputs):
        setattr(module, self.name, self.compute_weight(module, do_power_iteration=module.training))

    @staticmethod
    def apply(module, name, coeff, n_power_iterations, dim, eps):
        fn = SpectralNorm(coeff, name, n_power_iterations, dim, eps)
        weight = module._parameters[name]

        with torch.no_grad():
            weight_mat = fn.reshape_weight_to_matrix(weight)

            h, w = weight_mat.size()
            u = normalize(weight.new_empty(h).normal_(0, 1), dim=0, eps=fn.eps)
            v = normalize(weight.new_empty(w).normal_(0, 1), dim=0, eps=fn.eps)

        delattr(module, fn.name)
        module.register_parameter(fn.name + "_orig", weight)
        setattr(module, fn.name, weight.data)
        module.register_buffer(fn.name + "_u", u)
        module.register_buffer(fn.name + "_v", v)
        module.register_buffer(fn.name + "_sigma", torch.ones(1).to(weight.device))

        module.register_forward_pre_hook(fn)
        return fn


def spectral_norm_fc(module, coeff, name='weight', n_power_iterations=1, eps=1e-12, dim=None):
    if dim is None:
        dim = 1 if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)) else 0
    SpectralNorm.apply(module, name, coeff, n_power_iterations, dim, eps)
    return module


class SpectralNormConv(object):
    def __init__(self, coeff, input_dim, name='weight', n_power_iterations=1, eps=1e-12):
        self.coeff = coeff
        self.input_dim = input_dim
        self.name = name
        self.n_power_iterations = n_power_iterations
        self.eps = eps

    def compute_weight(self, module, do_power_iteration):
        weight = getattr(module, self.name + '_orig')
        u = getattr(module, self.name + '_u')
        v = getattr(module, self.name + '_v')
        sigma_log = getattr(module, self.name + '_sigma')  # for logging

        stride = module.stride
        padding = module.padding

        if do_power_iteration:
            with torch.no_grad():
                for _ in range(self.n_power_iterations):
                    v_s = conv_transpose2d(u.view(self.out_shape), weight, stride=stride,
                                           padding=padding, output_padding=0)
                    v = normalize(v_s.view(-1), dim=0, eps=self.eps, out=v)

                    u_s = conv2d(v.view(self.input_dim), weight, stride=stride, padding=padding,
                                 bias=None)
                    u = normalize(u_s.view(-1), dim=0, eps=self.eps, out=u)
                if self.n_power_iterations > 0:
                    u = u.clone()
                    v = v.clone()
        weight_v = conv2d(v.view(self.input_dim), weight, stride=stride, padding=padding,
                          bias=None)
        weight_v = weight_v.view(-1)
        sigma = torch.dot(u.view(-1), weight_v)
        factorReverse = torch.max(torch.ones(1).to(weight.device),
                                  sigma / self.coeff)
        sigma_log.copy_(sigma.detach())

        weight = weight / (factorReverse + 1e-5)  # for stability
        return weight

    def __call__(self, module, inputs):
        setattr(module, self.name, self.compute_weight(module, do_power_iteration=module.training))

    @staticmethod
    def apply(module, coeff, input_dim, name, n_power_iterations, eps):
        fn = SpectralNormConv(coeff, input_dim, name, n_power_iterations, eps)
        weight = module._parameters[name]

        with torch.no_grad():
            num_input_dim = input_dim[0] * input_dim[1] * input_dim[2] * input_dim[3]
            v = normalize(torch.randn(num_input_dim), dim=0, eps=fn.eps)

            stride = module.stride
            padding = module.padding
            u = conv2d(v.view(input_dim), weight, stride=stride, padding=padding,
                       bias=None)
            fn.out_shape = u.shape
            num_output_dim = fn.out_shape[0] * fn.out_shape[1] * fn.out_shape[2] * fn.out_shape[3]
            u = normalize(torch.randn(num_output_dim), dim=0, eps=fn.eps)

        delattr(module, fn.name)
        module.register_parameter(fn.name + "_orig", weight)
        setattr(module, fn.name, weight.data)
        module.register_buffer(fn.name + "_u", u)
        module.register_buffer(fn.name + "_v", v)
        module.register_buffer(fn.name + "_sigma", torch.ones(1).to(weight.device))

        module.register_forward_pre_hook(fn)
        return fn


def spectral_norm_conv(module, coeff, input_dim, name='weight', n_power_iterations=1, eps=1e-12):
    input_dim_4d = (1, input_dim[0], input_dim[1], input_dim[2])
    SpectralNormConv.apply(module, coeff, input_dim_4d, name, n_power_iterations, eps)
    return module


# -- models/model_utils.py --------------------------------------------------------------------------------
class injective_pad(nn.Module):
    def __init__(self, pad_size):
        super(injective_pad, self).__init__()
        self.pad_size = pad_size
        self.pad = nn.ZeroPad2d((0, 0, 0, pad_size))

    def forward(self, x):
        x = x.permute(0, 2, 1, 3)
        x = self.pad(x)
        return x.permute(0, 2, 1, 3)


class Squeeze(nn.Module):
    """The source's ``squeeze``."""

    def __init__(self, block_size):
        super(Squeeze, self).__init__()
        self.block_size = block_size
        self.block_size_sq = block_size * block_size

    def forward(self, input):
        output = input.permute(0, 2, 3, 1)
        (batch_size, s_height, s_width, s_depth) = output.size()
        d_depth = s_depth * self.block_size_sq
        d_height = int(s_height / self.block_size)
        t_1 = output.split(self.block_size, 2)
        stack = [t_t.contiguous().view(batch_size, d_height, d_depth) for t_t in t_1]
        output = torch.stack(stack, 1)
        output = output.permute(0, 2, 1, 3)
        output = output.permute(0, 3, 1, 2)
        return output.contiguous()


class ActNorm2D(nn.Module):
    def __init__(self, num_channels, eps=1e-5):
        super(ActNorm2D, self).__init__()
        self.eps = eps
        self.num_channels = num_channels
        self._log_scale = Parameter(torch.Tensor(num_channels))
        self._shift = Parameter(torch.Tensor(num_channels))
        self._init = False

    def log_scale(self):
        return self._log_scale[None, :, None, None]

    def shift(self):
        return self._shift[None, :, None, None]

    def forward(self, x):
        if not self._init:
            with torch.no_grad():
                # initialize params to input stats
                assert self.num_channels == x.size(1)
                mean = torch.transpose(x, 0, 1).contiguous().view(self.num_channels, -1).mean(dim=1)
                zero_mean = x - mean[None, :, None, None]
                var = torch.transpose(zero_mean ** 2, 0, 1).contiguous().view(self.num_channels, -1).mean(dim=1)
                std = (var + self.eps) ** .5
                log_scale = torch.log(1. / std)
                self._shift.data = - mean * torch.exp(log_scale)
                self._log_scale.data = log_scale
                self._init = True
        log_scale = self.log_scale()
        logdet = log_scale.sum() * x.size(2) * x.size(3)
        return x * torch.exp(log_scale) + self.shift(), logdet


# -- models/conv_iResNet.py -------------------------------------------------------------------------------
def downsample_shape(shape):
    return (shape[0] * 4, shape[1] // 2, shape[2] // 2)


class conv_iresnet_block(nn.Module):
    def __init__(self, in_shape, int_ch, numTraceSamples=0, numSeriesTerms=0,
                 stride=1, coeff=.97, input_nonlin=True,
                 actnorm=True, n_power_iter=5, nonlin="elu"):
        super(conv_iresnet_block, self).__init__()
        assert stride in (1, 2)
        self.stride = stride
        self.squeeze = Squeeze(stride)
        self.coeff = coeff
        self.numTraceSamples = numTraceSamples
        self.numSeriesTerms = numSeriesTerms
        self.n_power_iter = n_power_iter
        nonlin = {
            "relu": nn.ReLU,
            "elu": nn.ELU,
            "softplus": nn.Softplus,
        }[nonlin]

        # set shapes for spectral norm conv
        in_ch, h, w = in_shape

        layers = []
        if input_nonlin:
            layers.append(nonlin())

        in_ch = in_ch * stride**2
        kernel_size1 = 3  # kernel size for first conv
        layers.append(self._wrapper_spectral_norm(nn.Conv2d(in_ch, int_ch, kernel_size=kernel_size1, stride=1,
                                                            padding=1), (in_ch, h, w), kernel_size1))
        layers.append(nonlin())
        kernel_size2 = 1  # kernel size for second conv
        layers.append(self._wrapper_spectral_norm(nn.Conv2d(int_ch, int_ch, kernel_size=kernel_size2, padding=0),
                                                  (int_ch, h, w), kernel_size2))
        layers.append(nonlin())
        kernel_size3 = 3  # kernel size for third conv
        layers.append(self._wrapper_spectral_norm(nn.Conv2d(int_ch, in_ch, kernel_size=kernel_size3, padding=1),
                                                  (int_ch, h, w), kernel_size3))
        self.bottleneck_block = nn.Sequential(*layers)
        if actnorm:
            self.actnorm = ActNorm2D(in_ch)
        else:
            self.actnorm = None

    def forward(self, x, ignore_logdet=False):
        """ bijective or injective block forward """
        if self.stride == 2:
            x = self.squeeze.forward(x)

        if self.actnorm is not None:
            x, an_logdet = self.actnorm(x)
        else:
            an_logdet = 0.0

        Fx = self.bottleneck_block(x)
        # Compute approximate trace for use in training
        if (self.numTraceSamples == 0 and self.numSeriesTerms == 0) or ignore_logdet:
            trace = torch.tensor(0.)
        else:
            trace = power_series_matrix_logarithm_trace(Fx, x, self.numSeriesTerms, self.numTraceSamples)

        # add residual to output
        y = Fx + x
        return y, trace + an_logdet

    def _wrapper_spectral_norm(self, layer, shapes, kernel_size):
        if kernel_size == 1:
            # use spectral norm fc, because bound are tight for 1x1 convolutions
            return spectral_norm_fc(layer, self.coeff,
                                    n_power_iterations=self.n_power_iter)
        else:
            # use spectral norm based on conv, because bound not tight
            return spectral_norm_conv(layer, self.coeff, shapes,
                                      n_power_iterations=self.n_power_iter)


class conv_iResNet(nn.Module):
    """The source's, for density estimation (no classifier)."""

    def __init__(self, in_shape, nBlocks, nStrides, nChannels, init_ds=2, inj_pad=0,
                 coeff=.9, density_estimation=False, nClasses=None,
                 numTraceSamples=1, numSeriesTerms=1,
                 n_power_iter=5,
                 block=conv_iresnet_block,
                 actnorm=True, learn_prior=True,
                 nonlin="relu"):
        super(conv_iResNet, self).__init__()
        assert len(nBlocks) == len(nStrides) == len(nChannels)
        assert init_ds in (1, 2), "can only squeeze by 2"
        assert density_estimation and nClasses is None
        self.init_ds = init_ds
        self.ipad = inj_pad
        self.nBlocks = nBlocks
        self.density_estimation = density_estimation
        self.nClasses = nClasses
        # parameters for trace estimation
        self.numTraceSamples = numTraceSamples if density_estimation else 0
        self.numSeriesTerms = numSeriesTerms if density_estimation else 0
        self.n_power_iter = n_power_iter

        self.init_squeeze = Squeeze(self.init_ds)
        self.inj_pad = injective_pad(inj_pad)
        if self.init_ds == 2:
            in_shape = downsample_shape(in_shape)
        in_shape = (in_shape[0] + inj_pad, in_shape[1], in_shape[2])  # adjust channels

        self.stack, self.in_shapes, self.final_shape = self._make_stack(nChannels, nBlocks, nStrides,
                                                                        in_shape, coeff, block,
                                                                        actnorm, n_power_iter, nonlin)

        # make prior distribution
        self._make_prior(learn_prior)
        self.logits = None

    def _make_prior(self, learn_prior):
        dim = np.prod(self.in_shapes[0])
        self.prior_mu = nn.Parameter(torch.zeros((dim,)).float(), requires_grad=learn_prior)
        self.prior_logstd = nn.Parameter(torch.zeros((dim,)).float(), requires_grad=learn_prior)

    def prior(self):
        return distributions.Normal(self.prior_mu, torch.exp(self.prior_logstd))

    def logpz(self, z):
        return self.prior().log_prob(z.view(z.size(0), -1)).sum(dim=1)

    def _make_stack(self, nChannels, nBlocks, nStrides, in_shape, coeff, block,
                    actnorm, n_power_iter, nonlin):
        """ Create stack of iresnet blocks """
        block_list = nn.ModuleList()
        in_shapes = []
        for i, (int_dim, stride, blocks) in enumerate(zip(nChannels, nStrides, nBlocks)):
            for j in range(blocks):
                in_shapes.append(in_shape)
                block_list.append(block(in_shape, int_dim,
                                        numTraceSamples=self.numTraceSamples,
                                        numSeriesTerms=self.numSeriesTerms,
                                        stride=(stride if j == 0 else 1),  # use stride if first layer in block else 1
                                        input_nonlin=(i + j > 0),  # add nonlinearity to input for all but fist layer
                                        coeff=coeff,
                                        actnorm=actnorm,
                                        n_power_iter=n_power_iter,
                                        nonlin=nonlin))
                if stride == 2 and j == 0:
                    in_shape = downsample_shape(in_shape)

        return block_list, in_shapes, in_shape

    def forward(self, x, ignore_logdet=False):
        """ iresnet forward """
        if self.init_ds == 2:
            x = self.init_squeeze.forward(x)

        if self.ipad != 0:
            x = self.inj_pad.forward(x)

        z = x
        traces = []
        for block in self.stack:
            z, trace = block(z, ignore_logdet=ignore_logdet)
            traces.append(trace)

        # add logdets
        tmp_trace = torch.zeros_like(traces[0])
        for k in range(len(traces)):
            tmp_trace += traces[k]

        logpz = self.logpz(z)
        return z, logpz, tmp_trace


# -- models/utils_cifar.py, CIFAR_main.py -----------------------------------------------------------------
def bits_per_dim(logpx, inputs):
    return -logpx / float(np.log(2.) * np.prod(inputs.shape[1:])) + 8.


def update_lr(optimizer, lr):
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr


def get_init_batch(dataloader, batch_size):
    batches = []
    seen = 0
    for x, y in dataloader:
        batches.append(x)
        seen += x.size(0)
        if seen >= batch_size:
            break
    batch = torch.cat(batches)
    return batch


def cifar():
    gen = torch.Generator().manual_seed(17)
    return [(torch.rand(BATCH, *IN_SHAPE, generator=gen) - 0.5, torch.zeros(BATCH, dtype=torch.long))
            for _ in range(PER_EPOCH)]


def iresnet():
    """``get_model`` (without ``-multiScale``), then the actnorm initialization on the first batches."""
    model = conv_iResNet(nBlocks=args.nBlocks, nStrides=args.nStrides, nChannels=args.nChannels, nClasses=None,
                         init_ds=args.init_ds, inj_pad=args.inj_pad, in_shape=IN_SHAPE, coeff=args.coeff,
                         numTraceSamples=args.numTraceSamples, numSeriesTerms=args.numSeriesTerms,
                         n_power_iter=args.powerIterSpectralNorm, density_estimation=args.densityEstimation,
                         actnorm=True, learn_prior=True, nonlin=args.nonlin)
    init_batch = get_init_batch(cifar(), INIT_BATCH)
    with torch.no_grad():
        model(init_batch, ignore_logdet=True)
    return model


def density_loss(model, inputs):
    inputs = Variable(inputs, requires_grad=True)
    _, logpz, trace = model(inputs)  # Forward Propagation
    # compute loss
    logpx = logpz + trace
    return bits_per_dim(logpx, inputs).mean()


def warmup(optimizer, epoch, batch_idx, n_batches):
    cur_iter = (epoch - 1) * n_batches + batch_idx
    # if first epoch use warmup
    if epoch - 1 <= args.warmup_epochs:
        this_lr = args.lr * float(cur_iter) / (args.warmup_epochs * n_batches)
        update_lr(optimizer, this_lr)


def iresnet_hand(model, trainloader):
    optimizer = optim.Adamax(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    for epoch in range(1, 1 + args.epochs):
        model.train()
        for batch_idx, (inputs, targets) in enumerate(trainloader):
            warmup(optimizer, epoch, batch_idx, len(trainloader))
            optimizer.zero_grad()
            loss = density_loss(model, inputs)
            loss.backward()  # Backward Propagation
            optimizer.step()  # Optimizer update


class IResNet(Trainer):
    def configure_optimizers(self):
        return optim.Adamax(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def on_epoch_start(self):
        self.model.train()

    def on_step_start(self):
        # state.epoch counts from 0, the source's from 1; the step's batch is already taken (batch_in_epoch)
        warmup(self.optimizers["optimizer"], self.state.epoch + 1, self.state.batch_in_epoch - 1, PER_EPOCH)

    def training_step(self, batch):
        inputs, targets = batch
        return density_loss(self.model, inputs)


@pytest.mark.parametrize("check", checks())
def test_iresnet_density_estimation_with_a_power_series_log_determinant(check):
    data = cifar()
    compare(iresnet, iresnet_hand, IResNet, lambda model: data, check, steps=args.epochs * PER_EPOCH)


@pytest.mark.parametrize("check", checks())
def test_iresnet_port_alone(check):
    """The port against the hand loop without ``watch``."""
    torch.manual_seed(0)
    ref = iresnet()
    ours = copy.deepcopy(ref)
    torch.manual_seed(1)
    iresnet_hand(ref, cifar())
    torch.manual_seed(1)
    IResNet(model=ours, train_data=cifar(), max_steps=args.epochs * PER_EPOCH, device="cpu", progress=False,
            loggers=(), guard={"check": check}).fit()
    assert_same(ours, ref)
