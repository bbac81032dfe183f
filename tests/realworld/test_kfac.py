"""K-FAC, a natural-gradient optimizer fed by module hooks: alecwangcq/KFAC-Pytorch at commit
25e6dbe14752348d4f6030697b4b7f553ead2e92, optimizers/kfac.py (``KFACOptimizer``), utils/kfac_utils.py
(``ComputeCovA``, ``ComputeCovG``, ``_extract_patches``, ``update_running_stat``), models/cifar/vgg.py (``VGG``,
``make_layers``) and main.py (``train``, the optimizer and its ``MultiStepLR``).

- The optimizer registers a forward pre-hook and a (non-full) backward hook on every Linear and Conv2d: the
  pre-hook accumulates the inputs' covariance (unfolded patches for convolutions) into running statistics
  updated in place, on every forward with gradients enabled of a step where ``steps % TCov == 0``; the
  backward hook accumulates the output gradients' covariance, while ``acc_stats`` is set.
- On those steps the loop samples labels from the model's own predictions (``torch.multinomial`` of the
  softmax, under ``no_grad``), back-propagates that sampled loss with ``retain_graph=True`` only to feed the
  backward hooks (the true Fisher), clears the gradients it left (``optimizer.zero_grad()``), then
  back-propagates the real loss through the same graph.
- ``step`` eigendecomposes the statistics every ``TInv`` steps, preconditions each layer's gradient,
  rescales them all by a KL-clipping factor and writes them back into ``.grad`` in place
  (``grad.data.copy_``, ``mul_``), then runs its own momentum SGD through ``p.data.add_``.
- ``MultiStepLR`` is stepped at the start of every epoch (before the updates, as PyTorch before 1.1 had it).

Changes for a seconds-long test: a VGG of two conv-BN-ReLU-pool stages (8 and 16 channels) on 8x8 images,
its classifier ``Linear(64, 3)`` (``Linear(512, ...)``), 2 epochs of 3 batches of 8 (CIFAR-10, 100 epochs of
64), ``TCov`` 2 and ``TInv`` 4 (10 and 100) so that both happen in the run; ``torch.symeig`` (removed from
PyTorch) is ``torch.linalg.eigh`` (the same upper triangle); the torch 0.4 arithmetic calls with a leading
scalar (``add_(weight_decay, p.data)``, ``add_(1, d_p)``, ``add_(-lr, d_p)``) take ``alpha=``; no CUDA
(``.cuda()`` on the sampled labels left out); the progress bar, accuracy, TensorBoard writer and
``lr_scheduler.get_lr()`` (only logged) are left out.

The port returns the loss from ``training_step`` after the Fisher pass (which stays as the source has it:
its own ``backward(retain_graph=True)`` and ``optimizer.zero_grad()``); the scheduler is stepped in
``on_epoch_start``.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import MultiStepLR

from safeloop import Trainer

from .harness import checks, compare

args = type("args", (), dict(learning_rate=0.01, momentum=0.9, stat_decay=0.95, damping=1e-3, kl_clip=1e-2,
                             weight_decay=3e-3, TCov=2, TInv=4, epoch=2))
CLASSES, SIZE, BATCH, PER_EPOCH = 3, 8, 8, 3


# -- utils/kfac_utils.py ----------------------------------------------------------------------------------
def try_contiguous(x):
    if not x.is_contiguous():
        x = x.contiguous()

    return x


def _extract_patches(x, kernel_size, stride, padding):
    if padding[0] + padding[1] > 0:
        x = F.pad(x, (padding[1], padding[1], padding[0],
                      padding[0])).data  # Actually check dims
    x = x.unfold(2, kernel_size[0], stride[0])
    x = x.unfold(3, kernel_size[1], stride[1])
    x = x.transpose_(1, 2).transpose_(2, 3).contiguous()
    x = x.view(
        x.size(0), x.size(1), x.size(2),
        x.size(3) * x.size(4) * x.size(5))
    return x


def update_running_stat(aa, m_aa, stat_decay):
    # using inplace operation to save memory!
    m_aa *= stat_decay / (1 - stat_decay)
    m_aa += aa
    m_aa *= (1 - stat_decay)


class ComputeCovA:

    @classmethod
    def __call__(cls, a, layer):
        if isinstance(layer, nn.Linear):
            cov_a = cls.linear(a, layer)
        elif isinstance(layer, nn.Conv2d):
            cov_a = cls.conv2d(a, layer)
        else:
            cov_a = None

        return cov_a

    @staticmethod
    def conv2d(a, layer):
        batch_size = a.size(0)
        a = _extract_patches(a, layer.kernel_size, layer.stride, layer.padding)
        spatial_size = a.size(1) * a.size(2)
        a = a.view(-1, a.size(-1))
        if layer.bias is not None:
            a = torch.cat([a, a.new(a.size(0), 1).fill_(1)], 1)
        a = a / spatial_size
        return a.t() @ (a / batch_size)

    @staticmethod
    def linear(a, layer):
        # a: batch_size * in_dim
        batch_size = a.size(0)
        if layer.bias is not None:
            a = torch.cat([a, a.new(a.size(0), 1).fill_(1)], 1)
        return a.t() @ (a / batch_size)


class ComputeCovG:

    @classmethod
    def __call__(cls, g, layer, batch_averaged):
        if isinstance(layer, nn.Conv2d):
            cov_g = cls.conv2d(g, layer, batch_averaged)
        elif isinstance(layer, nn.Linear):
            cov_g = cls.linear(g, layer, batch_averaged)
        else:
            cov_g = None

        return cov_g

    @staticmethod
    def conv2d(g, layer, batch_averaged):
        # g: batch_size * n_filters * out_h * out_w
        # n_filters is actually the output dimension (analogous to Linear layer)
        spatial_size = g.size(2) * g.size(3)
        batch_size = g.shape[0]
        g = g.transpose(1, 2).transpose(2, 3)
        g = try_contiguous(g)
        g = g.view(-1, g.size(-1))

        if batch_averaged:
            g = g * batch_size
        g = g * spatial_size
        cov_g = g.t() @ (g / g.size(0))

        return cov_g

    @staticmethod
    def linear(g, layer, batch_averaged):
        # g: batch_size * out_dim
        batch_size = g.size(0)

        if batch_averaged:
            cov_g = g.t() @ (g * batch_size)
        else:
            cov_g = g.t() @ (g / batch_size)
        return cov_g


# -- optimizers/kfac.py -----------------------------------------------------------------------------------
class KFACOptimizer(optim.Optimizer):
    def __init__(self,
                 model,
                 lr=0.001,
                 momentum=0.9,
                 stat_decay=0.95,
                 damping=0.001,
                 kl_clip=0.001,
                 weight_decay=0,
                 TCov=10,
                 TInv=100,
                 batch_averaged=True):
        if lr < 0.0:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if momentum < 0.0:
            raise ValueError("Invalid momentum value: {}".format(momentum))
        if weight_decay < 0.0:
            raise ValueError("Invalid weight_decay value: {}".format(weight_decay))
        defaults = dict(lr=lr, momentum=momentum, damping=damping,
                        weight_decay=weight_decay)
        # TODO (CW): KFAC optimizer now only support model as input
        super(KFACOptimizer, self).__init__(model.parameters(), defaults)
        self.CovAHandler = ComputeCovA()
        self.CovGHandler = ComputeCovG()
        self.batch_averaged = batch_averaged

        self.known_modules = {'Linear', 'Conv2d'}

        self.modules = []
        self.grad_outputs = {}

        self.model = model
        self._prepare_model()

        self.steps = 0

        self.m_aa, self.m_gg = {}, {}
        self.Q_a, self.Q_g = {}, {}
        self.d_a, self.d_g = {}, {}
        self.stat_decay = stat_decay

        self.kl_clip = kl_clip
        self.TCov = TCov
        self.TInv = TInv

    def _save_input(self, module, input):
        if torch.is_grad_enabled() and self.steps % self.TCov == 0:
            aa = self.CovAHandler(input[0].data, module)
            # Initialize buffers
            if self.steps == 0:
                self.m_aa[module] = torch.diag(aa.new(aa.size(0)).fill_(1))
            update_running_stat(aa, self.m_aa[module], self.stat_decay)

    def _save_grad_output(self, module, grad_input, grad_output):
        # Accumulate statistics for Fisher matrices
        if self.acc_stats and self.steps % self.TCov == 0:
            gg = self.CovGHandler(grad_output[0].data, module, self.batch_averaged)
            # Initialize buffers
            if self.steps == 0:
                self.m_gg[module] = torch.diag(gg.new(gg.size(0)).fill_(1))
            update_running_stat(gg, self.m_gg[module], self.stat_decay)

    def _prepare_model(self):
        count = 0
        for module in self.model.modules():
            classname = module.__class__.__name__
            if classname in self.known_modules:
                self.modules.append(module)
                module.register_forward_pre_hook(self._save_input)
                module.register_backward_hook(self._save_grad_output)
                count += 1

    def _update_inv(self, m):
        eps = 1e-10  # for numerical stability
        self.d_a[m], self.Q_a[m] = torch.linalg.eigh(self.m_aa[m], UPLO='U')  # torch.symeig(..., eigenvectors=True)
        self.d_g[m], self.Q_g[m] = torch.linalg.eigh(self.m_gg[m], UPLO='U')

        self.d_a[m].mul_((self.d_a[m] > eps).float())
        self.d_g[m].mul_((self.d_g[m] > eps).float())

    @staticmethod
    def _get_matrix_form_grad(m, classname):
        if classname == 'Conv2d':
            p_grad_mat = m.weight.grad.data.view(m.weight.grad.data.size(0), -1)  # n_filters * (in_c * kw * kh)
        else:
            p_grad_mat = m.weight.grad.data
        if m.bias is not None:
            p_grad_mat = torch.cat([p_grad_mat, m.bias.grad.data.view(-1, 1)], 1)
        return p_grad_mat

    def _get_natural_grad(self, m, p_grad_mat, damping):
        # p_grad_mat is of output_dim * input_dim
        # inv((ss')) p_grad_mat inv(aa') = [ Q_g (1/R_g) Q_g^T ] @ p_grad_mat @ [Q_a (1/R_a) Q_a^T]
        v1 = self.Q_g[m].t() @ p_grad_mat @ self.Q_a[m]
        v2 = v1 / (self.d_g[m].unsqueeze(1) * self.d_a[m].unsqueeze(0) + damping)
        v = self.Q_g[m] @ v2 @ self.Q_a[m].t()
        if m.bias is not None:
            # we always put gradient w.r.t weight in [0]
            # and w.r.t bias in [1]
            v = [v[:, :-1], v[:, -1:]]
            v[0] = v[0].view(m.weight.grad.data.size())
            v[1] = v[1].view(m.bias.grad.data.size())
        else:
            v = [v.view(m.weight.grad.data.size())]

        return v

    def _kl_clip_and_update_grad(self, updates, lr):
        # do kl clip
        vg_sum = 0
        for m in self.modules:
            v = updates[m]
            vg_sum += (v[0] * m.weight.grad.data * lr ** 2).sum().item()
            if m.bias is not None:
                vg_sum += (v[1] * m.bias.grad.data * lr ** 2).sum().item()
        nu = min(1.0, math.sqrt(self.kl_clip / vg_sum))

        for m in self.modules:
            v = updates[m]
            m.weight.grad.data.copy_(v[0])
            m.weight.grad.data.mul_(nu)
            if m.bias is not None:
                m.bias.grad.data.copy_(v[1])
                m.bias.grad.data.mul_(nu)

    def _step(self, closure):
        for group in self.param_groups:
            weight_decay = group['weight_decay']
            momentum = group['momentum']

            for p in group['params']:
                if p.grad is None:
                    continue
                d_p = p.grad.data
                if weight_decay != 0 and self.steps >= 20 * self.TCov:
                    d_p.add_(p.data, alpha=weight_decay)
                if momentum != 0:
                    param_state = self.state[p]
                    if 'momentum_buffer' not in param_state:
                        buf = param_state['momentum_buffer'] = torch.zeros_like(p.data)
                        buf.mul_(momentum).add_(d_p)
                    else:
                        buf = param_state['momentum_buffer']
                        buf.mul_(momentum).add_(d_p, alpha=1)
                    d_p = buf

                p.data.add_(d_p, alpha=-group['lr'])

    def step(self, closure=None):
        # FIXME(CW): temporal fix for compatibility with Official LR scheduler.
        group = self.param_groups[0]
        lr = group['lr']
        damping = group['damping']
        updates = {}
        for m in self.modules:
            classname = m.__class__.__name__
            if self.steps % self.TInv == 0:
                self._update_inv(m)
            p_grad_mat = self._get_matrix_form_grad(m, classname)
            v = self._get_natural_grad(m, p_grad_mat, damping)
            updates[m] = v
        self._kl_clip_and_update_grad(updates, lr)

        self._step(closure)
        self.steps += 1


# -- models/cifar/vgg.py ----------------------------------------------------------------------------------
class VGG(nn.Module):

    def __init__(self, features, num_classes=1000, **kwargs):
        super(VGG, self).__init__()
        self.features = features
        self.classifier = nn.Linear(64, num_classes)  # 512
        self._initialize_weights()

    def forward(self, x):
        x = self.features(x)
        x = x.view(x.size(0), -1)
        x = self.classifier(x)
        return x

    def _initialize_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                m.weight.data.normal_(0, math.sqrt(2. / n))
                if m.bias is not None:
                    m.bias.data.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()
            elif isinstance(m, nn.Linear):
                n = m.weight.size(1)
                m.weight.data.normal_(0, 0.01)
                m.bias.data.zero_()


def make_layers(cfg, batch_norm=False):
    layers = []
    in_channels = 3
    for v in cfg:
        if v == 'M':
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
        else:
            conv2d = nn.Conv2d(in_channels, v, kernel_size=3, padding=1)
            if batch_norm:
                layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
            else:
                layers += [conv2d, nn.ReLU(inplace=True)]
            in_channels = v
    return nn.Sequential(*layers)


def vgg_bn():
    return VGG(make_layers([8, 'M', 16, 'M'], batch_norm=True), num_classes=CLASSES)


# -- main.py ----------------------------------------------------------------------------------------------
criterion = nn.CrossEntropyLoss()


def make_optimizer(net):
    optimizer = KFACOptimizer(net,
                              lr=args.learning_rate,
                              momentum=args.momentum,
                              stat_decay=args.stat_decay,
                              damping=args.damping,
                              kl_clip=args.kl_clip,
                              weight_decay=args.weight_decay,
                              TCov=args.TCov,
                              TInv=args.TInv)
    lr_scheduler = MultiStepLR(optimizer, milestones=[int(args.epoch * 0.5), int(args.epoch * 0.75)], gamma=0.1)
    return optimizer, lr_scheduler


def fisher_pass(optimizer, outputs):
    """The loop's true-Fisher pass, on the steps where the statistics are taken."""
    optim_name = 'kfac'
    if optim_name in ['kfac', 'ekfac'] and optimizer.steps % optimizer.TCov == 0:
        # compute true fisher
        optimizer.acc_stats = True
        with torch.no_grad():
            sampled_y = torch.multinomial(torch.nn.functional.softmax(outputs.cpu().data, dim=1),
                                          1).squeeze()
        loss_sample = criterion(outputs, sampled_y)
        loss_sample.backward(retain_graph=True)
        optimizer.acc_stats = False
        optimizer.zero_grad()  # clear the gradient for computing true-fisher.


def kfac_hand(net, trainloader):
    optimizer, lr_scheduler = make_optimizer(net)
    for epoch in range(args.epoch):
        net.train()
        lr_scheduler.step()
        for batch_idx, (inputs, targets) in enumerate(trainloader):
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, targets)
            fisher_pass(optimizer, outputs)
            loss.backward()
            optimizer.step()


class KFAC(Trainer):
    def configure_optimizers(self):
        optimizer, self.lr_scheduler = make_optimizer(self.model)
        return optimizer

    def on_epoch_start(self):
        self.model.train()
        self.lr_scheduler.step()

    def training_step(self, batch):
        inputs, targets = batch
        outputs = self.model(inputs)
        loss = criterion(outputs, targets)
        fisher_pass(self.optimizers["optimizer"], outputs)
        return loss


def cifar():
    gen = torch.Generator().manual_seed(15)
    return [(torch.randn(BATCH, 3, SIZE, SIZE, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(PER_EPOCH)]


@pytest.mark.parametrize("check", checks())
def test_kfac_with_a_sampled_fisher_backward(check):
    data = cifar()
    compare(vgg_bn, kfac_hand, KFAC, lambda model: data, check, steps=args.epoch * PER_EPOCH)
