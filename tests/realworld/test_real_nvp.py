"""A RealNVP normalizing flow: chrischute/real-nvp at commit df51ad570baf681e77df4d2265c0f1eb1b5b646c, train.py
(``main``, ``train``, ``test``, ``sample``), models/real_nvp/{real_nvp,coupling_layer,real_nvp_loss}.py,
models/resnet/{resnet,residual_block}.py and util/{array_util,norm_util,optim_util}.py.

- Dequantization noise (``torch.rand_like``) and a logit transform whose log-determinant starts ``sldj``;
  every coupling layer adds its own to it in place (``sldj += s.view(...).sum(-1)``).
- Checkerboard and channel-wise affine couplings; ``squeeze_2x2`` by reshapes and, in its alternate order, by a
  convolution with a permutation kernel built each call; a multi-scale split that factors half the channels
  out.
- The scale and translation nets are ResNets of weight-normalized convolutions and a weight-normalized
  ``Rescale``, all through the hook-based ``torch.nn.utils.weight_norm``: ``weight_g``/``weight_v``
  parameters, and a ``weight`` attribute recomputed with its graph by a forward pre-hook (and once by
  ``weight_norm`` itself, at construction); BatchNorm, the input doubled in place after it (``x *= 2.``), skip
  connections summed in place (``x_skip += skip(x)``).
- NaN checks on the scales (``torch.isnan(exp_s).any()``) in every coupling; an error on inputs outside [0, 1].
- Adam in two named groups (weight decay on the ``weight_g`` scales only); the gradient norm clipped per
  group (``util.clip_grad_norm``); after every epoch ``test`` (eval mode, ``no_grad``, dequantization noise
  drawn) and ``sample`` (the flow inverted from ``torch.randn`` latents).

Changes for a seconds-long test: 2 scales as the source, 4 middle channels (64), 1 residual block (8), 8x8
images (CIFAR-10's 32x32), 2 epochs of 3 training batches of 4 and one test batch, 4 samples (64); random
images in [0, 1] in place of CIFAR-10 and its flips; the checkpoint and sample files are left out.

``s.view(s.size(0), -1)`` in the couplings and ``prior_ll.view(...)`` in the loss are ``reshape``:
``squeeze_2x2``'s last ``permute`` leaves channels-last strides, which today's convolutions keep in their
outputs (the source's PyTorch made them contiguous), and ``view`` refuses those; the values are the same.

``weight_norm``'s ``weight`` attribute, a tensor with a graph, cannot be deep-copied
(pytorch/pytorch#103001): each run builds its model from the same seed instead (``compare(..., rebuild=True)``).

The port: ``training_step`` returns the loss; the per-group clipping is ``on_before_optimizer_step``
(``grad_clip`` clips all parameters together); ``on_epoch_start`` calls ``net.train()`` as ``train`` does,
``on_epoch_end`` runs ``test`` and ``sample``.
"""
import re
import warnings
from enum import IntEnum

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils as utils
import torch.optim as optim

from safeloop import Trainer

from .harness import checks, compare

MID, BLOCKS, SIZE, BATCH, PER_EPOCH, EPOCHS, SAMPLES = 4, 1, 8, 4, 3, 2, 4
args = type("args", (), dict(lr=1e-3, max_grad_norm=100., weight_decay=5e-5))


# -- util/array_util.py -----------------------------------------------------------------------------------
def squeeze_2x2(x, reverse=False, alt_order=False):
    block_size = 2  # noqa: F841 (the source's)
    if alt_order:
        n, c, h, w = x.size()

        if reverse:
            if c % 4 != 0:
                raise ValueError('Number of channels must be divisible by 4, got {}.'.format(c))
            c //= 4
        else:
            if h % 2 != 0:
                raise ValueError('Height must be divisible by 2, got {}.'.format(h))
            if w % 2 != 0:
                raise ValueError('Width must be divisible by 4, got {}.'.format(w))
        # Defines permutation of input channels (shape is (4, 1, 2, 2)).
        squeeze_matrix = torch.tensor([[[[1., 0.], [0., 0.]]],
                                       [[[0., 0.], [0., 1.]]],
                                       [[[0., 1.], [0., 0.]]],
                                       [[[0., 0.], [1., 0.]]]],
                                      dtype=x.dtype,
                                      device=x.device)
        perm_weight = torch.zeros((4 * c, c, 2, 2), dtype=x.dtype, device=x.device)
        for c_idx in range(c):
            slice_0 = slice(c_idx * 4, (c_idx + 1) * 4)
            slice_1 = slice(c_idx, c_idx + 1)
            perm_weight[slice_0, slice_1, :, :] = squeeze_matrix
        shuffle_channels = torch.tensor([c_idx * 4 for c_idx in range(c)]
                                        + [c_idx * 4 + 1 for c_idx in range(c)]
                                        + [c_idx * 4 + 2 for c_idx in range(c)]
                                        + [c_idx * 4 + 3 for c_idx in range(c)])
        perm_weight = perm_weight[shuffle_channels, :, :, :]

        if reverse:
            x = F.conv_transpose2d(x, perm_weight, stride=2)
        else:
            x = F.conv2d(x, perm_weight, stride=2)
    else:
        b, c, h, w = x.size()
        x = x.permute(0, 2, 3, 1)

        if reverse:
            if c % 4 != 0:
                raise ValueError('Number of channels {} is not divisible by 4'.format(c))
            x = x.view(b, h, w, c // 4, 2, 2)
            x = x.permute(0, 1, 4, 2, 5, 3)
            x = x.contiguous().view(b, 2 * h, 2 * w, c // 4)
        else:
            if h % 2 != 0 or w % 2 != 0:
                raise ValueError('Expected even spatial dims HxW, got {}x{}'.format(h, w))
            x = x.view(b, h // 2, 2, w // 2, 2, c)
            x = x.permute(0, 1, 3, 5, 2, 4)
            x = x.contiguous().view(b, h // 2, w // 2, c * 4)

        x = x.permute(0, 3, 1, 2)

    return x


def checkerboard_mask(height, width, reverse=False, dtype=torch.float32, device=None, requires_grad=False):
    checkerboard = [[((i % 2) + j) % 2 for j in range(width)] for i in range(height)]
    mask = torch.tensor(checkerboard, dtype=dtype, device=device, requires_grad=requires_grad)

    if reverse:
        mask = 1 - mask

    # Reshape to (1, 1, height, width) for broadcasting with tensors of shape (B, C, H, W)
    mask = mask.view(1, 1, height, width)

    return mask


# -- util/norm_util.py, util/optim_util.py ----------------------------------------------------------------
def get_param_groups(net, weight_decay, norm_suffix='weight_g', verbose=False):
    norm_params = []
    unnorm_params = []
    for n, p in net.named_parameters():
        if n.endswith(norm_suffix):
            norm_params.append(p)
        else:
            unnorm_params.append(p)

    param_groups = [{'name': 'normalized', 'params': norm_params, 'weight_decay': weight_decay},
                    {'name': 'unnormalized', 'params': unnorm_params}]
    return param_groups


class WNConv2d(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding, bias=True):
        super(WNConv2d, self).__init__()
        self.conv = nn.utils.weight_norm(
            nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, bias=bias))

    def forward(self, x):
        x = self.conv(x)

        return x


def clip_grad_norm(optimizer, max_norm, norm_type=2):
    for group in optimizer.param_groups:
        utils.clip_grad_norm_(group['params'], max_norm, norm_type)


# -- models/resnet ----------------------------------------------------------------------------------------
class ResidualBlock(nn.Module):
    """ResNet basic block with weight norm."""
    def __init__(self, in_channels, out_channels):
        super(ResidualBlock, self).__init__()

        self.in_norm = nn.BatchNorm2d(in_channels)
        self.in_conv = WNConv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)

        self.out_norm = nn.BatchNorm2d(out_channels)
        self.out_conv = WNConv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=True)

    def forward(self, x):
        skip = x

        x = self.in_norm(x)
        x = F.relu(x)
        x = self.in_conv(x)

        x = self.out_norm(x)
        x = F.relu(x)
        x = self.out_conv(x)

        x = x + skip

        return x


class ResNet(nn.Module):
    def __init__(self, in_channels, mid_channels, out_channels,
                 num_blocks, kernel_size, padding, double_after_norm):
        super(ResNet, self).__init__()
        self.in_norm = nn.BatchNorm2d(in_channels)
        self.double_after_norm = double_after_norm
        self.in_conv = WNConv2d(2 * in_channels, mid_channels, kernel_size, padding, bias=True)
        self.in_skip = WNConv2d(mid_channels, mid_channels, kernel_size=1, padding=0, bias=True)

        self.blocks = nn.ModuleList([ResidualBlock(mid_channels, mid_channels)
                                     for _ in range(num_blocks)])
        self.skips = nn.ModuleList([WNConv2d(mid_channels, mid_channels, kernel_size=1, padding=0, bias=True)
                                    for _ in range(num_blocks)])

        self.out_norm = nn.BatchNorm2d(mid_channels)
        self.out_conv = WNConv2d(mid_channels, out_channels, kernel_size=1, padding=0, bias=True)

    def forward(self, x):
        x = self.in_norm(x)
        if self.double_after_norm:
            x *= 2.
        x = torch.cat((x, -x), dim=1)
        x = F.relu(x)
        x = self.in_conv(x)
        x_skip = self.in_skip(x)

        for block, skip in zip(self.blocks, self.skips):
            x = block(x)
            x_skip += skip(x)

        x = self.out_norm(x_skip)
        x = F.relu(x)
        x = self.out_conv(x)

        return x


# -- models/real_nvp --------------------------------------------------------------------------------------
class MaskType(IntEnum):
    CHECKERBOARD = 0
    CHANNEL_WISE = 1


class CouplingLayer(nn.Module):
    def __init__(self, in_channels, mid_channels, num_blocks, mask_type, reverse_mask):
        super(CouplingLayer, self).__init__()

        # Save mask info
        self.mask_type = mask_type
        self.reverse_mask = reverse_mask

        # Build scale and translate network
        if self.mask_type == MaskType.CHANNEL_WISE:
            in_channels //= 2
        self.st_net = ResNet(in_channels, mid_channels, 2 * in_channels,
                             num_blocks=num_blocks, kernel_size=3, padding=1,
                             double_after_norm=(self.mask_type == MaskType.CHECKERBOARD))

        # Learnable scale for s
        self.rescale = nn.utils.weight_norm(Rescale(in_channels))

    def forward(self, x, sldj=None, reverse=True):
        if self.mask_type == MaskType.CHECKERBOARD:
            # Checkerboard mask
            b = checkerboard_mask(x.size(2), x.size(3), self.reverse_mask, device=x.device)
            x_b = x * b
            st = self.st_net(x_b)
            s, t = st.chunk(2, dim=1)
            s = self.rescale(torch.tanh(s))
            s = s * (1 - b)
            t = t * (1 - b)

            # Scale and translate
            if reverse:
                inv_exp_s = s.mul(-1).exp()
                if torch.isnan(inv_exp_s).any():
                    raise RuntimeError('Scale factor has NaN entries')
                x = x * inv_exp_s - t
            else:
                exp_s = s.exp()
                if torch.isnan(exp_s).any():
                    raise RuntimeError('Scale factor has NaN entries')
                x = (x + t) * exp_s

                # Add log-determinant of the Jacobian
                sldj += s.reshape(s.size(0), -1).sum(-1)  # .view: see the module's docstring
        else:
            # Channel-wise mask
            if self.reverse_mask:
                x_id, x_change = x.chunk(2, dim=1)
            else:
                x_change, x_id = x.chunk(2, dim=1)

            st = self.st_net(x_id)
            s, t = st.chunk(2, dim=1)
            s = self.rescale(torch.tanh(s))

            # Scale and translate
            if reverse:
                inv_exp_s = s.mul(-1).exp()
                if torch.isnan(inv_exp_s).any():
                    raise RuntimeError('Scale factor has NaN entries')
                x_change = x_change * inv_exp_s - t
            else:
                exp_s = s.exp()
                if torch.isnan(exp_s).any():
                    raise RuntimeError('Scale factor has NaN entries')
                x_change = (x_change + t) * exp_s

                # Add log-determinant of the Jacobian
                sldj += s.reshape(s.size(0), -1).sum(-1)  # .view: see the module's docstring

            if self.reverse_mask:
                x = torch.cat((x_id, x_change), dim=1)
            else:
                x = torch.cat((x_change, x_id), dim=1)

        return x, sldj


class Rescale(nn.Module):
    def __init__(self, num_channels):
        super(Rescale, self).__init__()
        self.weight = nn.Parameter(torch.ones(num_channels, 1, 1))

    def forward(self, x):
        x = self.weight * x
        return x


class RealNVP(nn.Module):
    def __init__(self, num_scales=2, in_channels=3, mid_channels=64, num_blocks=8):
        super(RealNVP, self).__init__()
        # Register data_constraint to pre-process images, not learnable
        self.register_buffer('data_constraint', torch.tensor([0.9], dtype=torch.float32))

        self.flows = _RealNVP(0, num_scales, in_channels, mid_channels, num_blocks)

    def forward(self, x, reverse=False):
        sldj = None
        if not reverse:
            # Expect inputs in [0, 1]
            if x.min() < 0 or x.max() > 1:
                raise ValueError('Expected x in [0, 1], got x with min/max {}/{}'
                                 .format(x.min(), x.max()))

            # De-quantize and convert to logits
            x, sldj = self._pre_process(x)

        x, sldj = self.flows(x, sldj, reverse)

        return x, sldj

    def _pre_process(self, x):
        y = (x * 255. + torch.rand_like(x)) / 256.
        y = (2 * y - 1) * self.data_constraint
        y = (y + 1) / 2
        y = y.log() - (1. - y).log()

        # Save log-determinant of Jacobian of initial transform
        ldj = F.softplus(y) + F.softplus(-y) \
            - F.softplus((1. - self.data_constraint).log() - self.data_constraint.log())
        sldj = ldj.view(ldj.size(0), -1).sum(-1)

        return y, sldj


class _RealNVP(nn.Module):
    def __init__(self, scale_idx, num_scales, in_channels, mid_channels, num_blocks):
        super(_RealNVP, self).__init__()

        self.is_last_block = scale_idx == num_scales - 1

        self.in_couplings = nn.ModuleList([
            CouplingLayer(in_channels, mid_channels, num_blocks, MaskType.CHECKERBOARD, reverse_mask=False),
            CouplingLayer(in_channels, mid_channels, num_blocks, MaskType.CHECKERBOARD, reverse_mask=True),
            CouplingLayer(in_channels, mid_channels, num_blocks, MaskType.CHECKERBOARD, reverse_mask=False)
        ])

        if self.is_last_block:
            self.in_couplings.append(
                CouplingLayer(in_channels, mid_channels, num_blocks, MaskType.CHECKERBOARD, reverse_mask=True))
        else:
            self.out_couplings = nn.ModuleList([
                CouplingLayer(4 * in_channels, 2 * mid_channels, num_blocks, MaskType.CHANNEL_WISE,
                              reverse_mask=False),
                CouplingLayer(4 * in_channels, 2 * mid_channels, num_blocks, MaskType.CHANNEL_WISE,
                              reverse_mask=True),
                CouplingLayer(4 * in_channels, 2 * mid_channels, num_blocks, MaskType.CHANNEL_WISE,
                              reverse_mask=False)
            ])
            self.next_block = _RealNVP(scale_idx + 1, num_scales, 2 * in_channels, 2 * mid_channels, num_blocks)

    def forward(self, x, sldj, reverse=False):
        if reverse:
            if not self.is_last_block:
                # Re-squeeze -> split -> next block
                x = squeeze_2x2(x, reverse=False, alt_order=True)
                x, x_split = x.chunk(2, dim=1)
                x, sldj = self.next_block(x, sldj, reverse)
                x = torch.cat((x, x_split), dim=1)
                x = squeeze_2x2(x, reverse=True, alt_order=True)

                # Squeeze -> 3x coupling (channel-wise)
                x = squeeze_2x2(x, reverse=False)
                for coupling in reversed(self.out_couplings):
                    x, sldj = coupling(x, sldj, reverse)
                x = squeeze_2x2(x, reverse=True)

            for coupling in reversed(self.in_couplings):
                x, sldj = coupling(x, sldj, reverse)
        else:
            for coupling in self.in_couplings:
                x, sldj = coupling(x, sldj, reverse)

            if not self.is_last_block:
                # Squeeze -> 3x coupling (channel-wise)
                x = squeeze_2x2(x, reverse=False)
                for coupling in self.out_couplings:
                    x, sldj = coupling(x, sldj, reverse)
                x = squeeze_2x2(x, reverse=True)

                # Re-squeeze -> split -> next block
                x = squeeze_2x2(x, reverse=False, alt_order=True)
                x, x_split = x.chunk(2, dim=1)
                x, sldj = self.next_block(x, sldj, reverse)
                x = torch.cat((x, x_split), dim=1)
                x = squeeze_2x2(x, reverse=True, alt_order=True)

        return x, sldj


class RealNVPLoss(nn.Module):
    def __init__(self, k=256):
        super(RealNVPLoss, self).__init__()
        self.k = k

    def forward(self, z, sldj):
        prior_ll = -0.5 * (z ** 2 + np.log(2 * np.pi))
        prior_ll = prior_ll.reshape(z.size(0), -1).sum(-1) \
            - np.log(self.k) * np.prod(z.size()[1:])
        ll = prior_ll + sldj
        nll = -ll.mean()

        return nll


# -- train.py ---------------------------------------------------------------------------------------------
def real_nvp():
    return RealNVP(num_scales=2, in_channels=3, mid_channels=MID, num_blocks=BLOCKS)


def sample(net, batch_size, device):
    z = torch.randn((batch_size, 3, SIZE, SIZE), dtype=torch.float32, device=device)  # (..., 3, 32, 32)
    x, _ = net(z, reverse=True)
    x = torch.sigmoid(x)

    return x


def test(epoch, net, testloader, device, loss_fn, num_samples):
    """The source's, without its checkpoint and image files; the test losses and samples kept in ``testloader``."""
    net.eval()
    with torch.no_grad():
        for x, _ in testloader:
            x = x.to(device)
            z, sldj = net(x, reverse=False)
            loss = loss_fn(z, sldj)
            testloader.losses.append(loss.item())
    images = sample(net, num_samples, device)
    testloader.samples.append(images)


test.__test__ = False  # the source's name: not one for pytest to collect


def train(epoch, net, trainloader, device, optimizer, loss_fn, max_grad_norm):
    net.train()
    for x, _ in trainloader:
        x = x.to(device)
        optimizer.zero_grad()
        z, sldj = net(x, reverse=False)
        loss = loss_fn(z, sldj)
        loss.backward()
        clip_grad_norm(optimizer, max_grad_norm)
        optimizer.step()


def real_nvp_hand(net, data):
    device = 'cpu'
    loss_fn = RealNVPLoss()
    param_groups = get_param_groups(net, args.weight_decay, norm_suffix='weight_g')
    optimizer = optim.Adam(param_groups, lr=args.lr)
    for epoch in range(0, EPOCHS):
        train(epoch, net, data, device, optimizer, loss_fn, args.max_grad_norm)
        test(epoch, net, data.test, device, loss_fn, SAMPLES)


class RealNVPTrainer(Trainer):
    def configure_optimizers(self):
        self.loss_fn = RealNVPLoss()
        return optim.Adam(get_param_groups(self.model, args.weight_decay, norm_suffix='weight_g'), lr=args.lr)

    def on_epoch_start(self):
        self.model.train()

    def training_step(self, batch):
        x, _ = batch
        z, sldj = self.model(x, reverse=False)
        return self.loss_fn(z, sldj)

    def on_before_optimizer_step(self, name, optimizer):
        clip_grad_norm(optimizer, args.max_grad_norm)

    def on_epoch_end(self):
        test(self.state.epoch, self.model, self.train_data.test, 'cpu', self.loss_fn, SAMPLES)


class Images:
    def __init__(self):
        gen = torch.Generator().manual_seed(16)

        def batch():
            return torch.rand(BATCH, 3, SIZE, SIZE, generator=gen), torch.zeros(BATCH, dtype=torch.long)
        self.batches = [batch() for _ in range(PER_EPOCH)]
        self.test = HeldOut([batch()])

    def __iter__(self):
        return iter(self.batches)


class HeldOut(list):
    def __init__(self, batches):
        super().__init__(batches)
        self.losses, self.samples = [], []


@pytest.mark.parametrize("check", checks())
def test_real_nvp_with_hook_based_weight_norm(check):
    runs = []

    def data(model):
        runs.append(Images())
        return runs[-1]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("`torch.nn.utils.weight_norm` is deprecated"))
        compare(real_nvp, real_nvp_hand, RealNVPTrainer, data, check, steps=EPOCHS * PER_EPOCH, rebuild=True)
    hand, watched, port = (run.test for run in runs)
    assert watched.losses == hand.losses and port.losses == hand.losses[:-1]
    assert all(torch.equal(a, b) for a, b in zip(port.samples, hand.samples))
