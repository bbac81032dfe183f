"""A joint energy-based model trained with SGLD samples and a replay buffer: wgrathwohl/JEM at commit
3d01161547109b464eee87304f07b2dac8519d03, train_wrn_ebm.py (``F``, ``CCF``, ``init_random``,
``get_model_and_buffer``, ``get_sample_q``, ``main``) and wideresnet.py (``Wide_ResNet``, ``wide_basic``),
with the README's CIFAR-10 command (Adam at 1e-4, ``p(x)`` and ``p(y|x)`` weighted 1, a learning-rate warmup).

Each step draws negative samples by stochastic gradient Langevin dynamics, inside the step:

- starting points from the replay buffer (a plain tensor, no buffer of the model) indexed by ``t.randint``,
  5% re-initialized from ``uniform_(-1, 1)``;
- the model put in eval mode; the sample a leaf that requires grad (``Variable(init, requires_grad=True)``);
  at each Langevin step ``t.autograd.grad(f(x_k).sum(), [x_k], retain_graph=True)`` (a retained graph never
  used again) and ``x_k.data += sgld_lr * f_prime + sgld_std * randn_like(x_k)`` (the leaf moved through
  ``.data`` while the retained graph saved it); then ``f.train()``;
- the samples detached and written back into the buffer in place (``replay_buffer[inds] = ...``).

The loss starts as the Python float ``L = 0.`` and gathers ``-(f(x_data).mean() - f(x_q).mean())`` (the
energy as ``logsumexp`` of the logits) and the cross-entropy of a labelled batch drawn from a cycled loader
(``__next__()``); a loss over 1e8 stops the run with ``1/0``. The learning rate is warmed up by assigning
``param_group['lr']`` while ``cur_iter <= warmup_iters``. The net is the source's default (no normalization)
and, in a second case, its ``--norm batch`` (``BatchNorm2d(momentum=0.9)``, which SGLD runs in eval mode).

Changes for a seconds-long test: a depth-10 width-1 Wide-ResNet (28 and 10), 3 classes, batches of 4, 5 SGLD
steps (20), a buffer of 12 (10000), a warmup of 3 iterations (1000), 6 steps of fixed seeded images with the
source's ``sigma`` noise added (CIFAR-10 and its augmentations, which add that noise in the DataLoader);
the source's ``init.xavier_uniform`` of ``conv_init`` is unused there too; the prints, plots, checkpoints and
evaluation are left out.

The port returns ``L`` from ``training_step``; the buffer and warmup live on the Trainer (the buffer drawn in
``configure_optimizers``, where the source draws it, after the model); the warmup in ``on_step_start``.
"""
from types import SimpleNamespace

import pytest
import torch
import torch as t
import torch.nn as nn
import torch.nn.functional as F_

from safeloop import Trainer

from .harness import checks, compare

seed = 1
im_sz = 32
n_ch = 3
STEPS = 6


def make_args(norm=None):
    return SimpleNamespace(lr=1e-4, decay_epochs=[160, 180], decay_rate=.3, clf_only=False, optimizer="adam",
                           batch_size=4, n_epochs=1, warmup_iters=3, p_x_weight=1., p_y_given_x_weight=1.,
                           p_x_y_weight=0., dropout_rate=0.0, sigma=3e-2, weight_decay=0.0, norm=norm, n_steps=5,
                           width=1, depth=10, uncond=False, class_cond_p_x_sample=False, buffer_size=12,
                           reinit_freq=.05, sgld_lr=1.0, sgld_std=1e-2, load_path=None, n_classes=3)


# -- wideresnet.py ----------------------------------------------------------------------------------------
class Identity(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x


class wide_basic(nn.Module):
    def __init__(self, in_planes, planes, dropout_rate, stride=1, norm=None, leak=.2):
        super(wide_basic, self).__init__()
        self.lrelu = nn.LeakyReLU(leak)
        self.bn1 = get_norm(in_planes, norm)
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, padding=1, bias=True)
        self.dropout = Identity() if dropout_rate == 0.0 else nn.Dropout(p=dropout_rate)
        self.bn2 = get_norm(planes, norm)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=True)

        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=True),
            )

    def forward(self, x):
        out = self.dropout(self.conv1(self.lrelu(self.bn1(x))))
        out = self.conv2(self.lrelu(self.bn2(out)))
        out += self.shortcut(x)

        return out


def get_norm(n_filters, norm):
    if norm is None:
        return Identity()
    elif norm == "batch":
        return nn.BatchNorm2d(n_filters, momentum=0.9)
    raise ValueError(norm)  # the source's "instance", "layer" and "act" are not used here


def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=True)


class Wide_ResNet(nn.Module):
    def __init__(self, depth, widen_factor, num_classes=10, input_channels=3,
                 sum_pool=False, norm=None, leak=.2, dropout_rate=0.0):
        super(Wide_ResNet, self).__init__()
        self.leak = leak
        self.in_planes = 16
        self.sum_pool = sum_pool
        self.norm = norm
        self.lrelu = nn.LeakyReLU(leak)

        assert ((depth - 4) % 6 == 0), 'Wide-resnet depth should be 6n+4'
        n = (depth - 4) // 6
        k = widen_factor

        nStages = [16, 16 * k, 32 * k, 64 * k]

        self.conv1 = conv3x3(input_channels, nStages[0])
        self.layer1 = self._wide_layer(wide_basic, nStages[1], n, dropout_rate, stride=1)
        self.layer2 = self._wide_layer(wide_basic, nStages[2], n, dropout_rate, stride=2)
        self.layer3 = self._wide_layer(wide_basic, nStages[3], n, dropout_rate, stride=2)
        self.bn1 = get_norm(nStages[3], self.norm)
        self.last_dim = nStages[3]
        self.linear = nn.Linear(nStages[3], num_classes)

    def _wide_layer(self, block, planes, num_blocks, dropout_rate, stride):
        strides = [stride] + [1] * (num_blocks - 1)
        layers = []

        for stride in strides:
            layers.append(block(self.in_planes, planes, dropout_rate, stride, norm=self.norm))
            self.in_planes = planes

        return nn.Sequential(*layers)

    def forward(self, x, vx=None):
        out = self.conv1(x)
        out = self.layer1(out)
        out = self.layer2(out)
        out = self.layer3(out)
        out = self.lrelu(self.bn1(out))
        if self.sum_pool:
            out = out.view(out.size(0), out.size(1), -1).sum(2)
        else:
            out = F_.avg_pool2d(out, 8)
        out = out.view(out.size(0), -1)
        return out


# -- train_wrn_ebm.py -------------------------------------------------------------------------------------
class F(nn.Module):
    def __init__(self, depth=28, width=2, norm=None, dropout_rate=0.0, n_classes=10):
        super(F, self).__init__()
        self.f = Wide_ResNet(depth, width, norm=norm, dropout_rate=dropout_rate)
        self.energy_output = nn.Linear(self.f.last_dim, 1)
        self.class_output = nn.Linear(self.f.last_dim, n_classes)

    def forward(self, x, y=None):
        penult_z = self.f(x)
        return self.energy_output(penult_z).squeeze()

    def classify(self, x):
        penult_z = self.f(x)
        return self.class_output(penult_z).squeeze()


class CCF(F):
    def __init__(self, depth=28, width=2, norm=None, dropout_rate=0.0, n_classes=10):
        super(CCF, self).__init__(depth, width, norm=norm, dropout_rate=dropout_rate, n_classes=n_classes)

    def forward(self, x, y=None):
        logits = self.classify(x)
        if y is None:
            return logits.logsumexp(1)
        else:
            return t.gather(logits, 1, y[:, None])


def init_random(args, bs):
    return t.FloatTensor(bs, n_ch, im_sz, im_sz).uniform_(-1, 1)


def get_model(args):
    """``get_model_and_buffer``'s model (its buffer is drawn by ``make_buffer``, after the model, as there)."""
    model_cls = F if args.uncond else CCF
    return model_cls(args.depth, args.width, args.norm, dropout_rate=args.dropout_rate, n_classes=args.n_classes)


def make_buffer(args):
    if not args.uncond:
        assert args.buffer_size % args.n_classes == 0, "Buffer size must be divisible by args.n_classes"
    return init_random(args, args.buffer_size)


def get_sample_q(args, device):
    def sample_p_0(replay_buffer, bs, y=None):
        if len(replay_buffer) == 0:
            return init_random(args, bs), []
        buffer_size = len(replay_buffer) if y is None else len(replay_buffer) // args.n_classes
        inds = t.randint(0, buffer_size, (bs,))
        # if cond, convert inds to class conditional inds
        if y is not None:
            inds = y.cpu() * buffer_size + inds
            assert not args.uncond, "Can't drawn conditional samples without giving me y"
        buffer_samples = replay_buffer[inds]
        random_samples = init_random(args, bs)
        choose_random = (t.rand(bs) < args.reinit_freq).float()[:, None, None, None]
        samples = choose_random * random_samples + (1 - choose_random) * buffer_samples
        return samples.to(device), inds

    def sample_q(f, replay_buffer, y=None, n_steps=args.n_steps):
        """this func takes in replay_buffer now so we have the option to sample from
        scratch (i.e. replay_buffer==[]).  See test_wrn_ebm.py for example.
        """
        f.eval()
        # get batch size
        bs = args.batch_size if y is None else y.size(0)
        # generate initial samples and buffer inds of those samples (if buffer is used)
        init_sample, buffer_inds = sample_p_0(replay_buffer, bs=bs, y=y)
        x_k = t.autograd.Variable(init_sample, requires_grad=True)
        # sgld
        for k in range(n_steps):
            f_prime = t.autograd.grad(f(x_k, y=y).sum(), [x_k], retain_graph=True)[0]
            x_k.data += args.sgld_lr * f_prime + args.sgld_std * t.randn_like(x_k)
        f.train()
        final_samples = x_k.detach()
        # update replay buffer
        if len(replay_buffer) > 0:
            replay_buffer[buffer_inds] = final_samples.cpu()
        return final_samples
    return sample_q


def make_optimizer(args, f):
    params = f.class_output.parameters() if args.clf_only else f.parameters()
    if args.optimizer == "adam":
        optim = t.optim.Adam(params, lr=args.lr, betas=[.9, .999], weight_decay=args.weight_decay)
    else:
        optim = t.optim.SGD(params, lr=args.lr, momentum=.9, weight_decay=args.weight_decay)
    return optim


def jem_loss(args, f, sample_q, replay_buffer, x_p_d, x_lab, y_lab):
    """The body of ``main``'s loop from ``L = 0.`` to the divergence check (the prints left out)."""
    L = 0.
    if args.p_x_weight > 0:  # maximize log p(x)
        if args.class_cond_p_x_sample:
            assert not args.uncond, "can only draw class-conditional samples if EBM is class-cond"
            y_q = t.randint(0, args.n_classes, (args.batch_size,))
            x_q = sample_q(f, replay_buffer, y=y_q)
        else:
            x_q = sample_q(f, replay_buffer)  # sample from log-sumexp

        fp_all = f(x_p_d)
        fq_all = f(x_q)
        fp = fp_all.mean()
        fq = fq_all.mean()

        l_p_x = -(fp - fq)
        L += args.p_x_weight * l_p_x

    if args.p_y_given_x_weight > 0:  # maximize log p(y | x)
        logits = f.classify(x_lab)
        l_p_y_given_x = nn.CrossEntropyLoss()(logits, y_lab)
        L += args.p_y_given_x_weight * l_p_y_given_x

    if args.p_x_y_weight > 0:  # maximize log p(x, y)
        assert not args.uncond, "this objective can only be trained for class-conditional EBM DUUUUUUUUHHHH!!!"
        x_q_lab = sample_q(f, replay_buffer, y=y_lab)
        fp, fq = f(x_lab, y_lab).mean(), f(x_q_lab, y_lab).mean()
        l_p_x_y = -(fp - fq)
        L += args.p_x_y_weight * l_p_x_y

    # break if the loss diverged...easier for poppa to run experiments this way
    if L.abs().item() > 1e8:
        print("BAD BOIIIIIIIIII")
        1 / 0
    return L


def jem_hand(f, data):
    args, dload_train, dload_train_labeled = data.args, data.train, data.labelled()
    device = t.device('cpu')
    sample_q = get_sample_q(args, device)
    replay_buffer = make_buffer(args)
    optim = make_optimizer(args, f)

    cur_iter = 0
    for epoch in range(args.n_epochs):
        if epoch in args.decay_epochs:
            for param_group in optim.param_groups:
                new_lr = param_group['lr'] * args.decay_rate
                param_group['lr'] = new_lr
        for i, (x_p_d, _) in enumerate(dload_train):
            if cur_iter <= args.warmup_iters:
                lr = args.lr * cur_iter / float(args.warmup_iters)
                for param_group in optim.param_groups:
                    param_group['lr'] = lr

            x_p_d = x_p_d.to(device)
            x_lab, y_lab = dload_train_labeled.__next__()
            x_lab, y_lab = x_lab.to(device), y_lab.to(device)

            L = jem_loss(args, f, sample_q, replay_buffer, x_p_d, x_lab, y_lab)

            optim.zero_grad()
            L.backward()
            optim.step()
            cur_iter += 1
    data.buffer = replay_buffer


class JEM(Trainer):
    def configure_optimizers(self):
        args = self.train_data.args
        self.sample_q = get_sample_q(args, t.device('cpu'))
        self.replay_buffer = make_buffer(args)
        self.labelled = self.train_data.labelled()
        return make_optimizer(args, self.model)

    def on_step_start(self):
        args, cur_iter = self.train_data.args, self.state.step
        if cur_iter <= args.warmup_iters:
            lr = args.lr * cur_iter / float(args.warmup_iters)
            for param_group in self.optimizers["optimizer"].param_groups:
                param_group['lr'] = lr

    def training_step(self, batch):
        x_p_d, _ = batch
        x_lab, y_lab = self.labelled.__next__()
        return jem_loss(self.train_data.args, self.model, self.sample_q, self.replay_buffer, x_p_d, x_lab, y_lab)

    def on_fit_end(self):
        self.train_data.buffer = self.replay_buffer


class Cifar:
    """The unlabelled batches (``dload_train``, iterated) and the cycled labelled ones (``labelled()``)."""

    def __init__(self, args):
        self.args = args
        gen = torch.Generator().manual_seed(8)

        def batch():
            x = torch.rand(args.batch_size, n_ch, im_sz, im_sz, generator=gen) * 2 - 1
            return (x + args.sigma * torch.randn(x.shape, generator=gen),
                    torch.randint(args.n_classes, (args.batch_size,), generator=gen))
        self.train = [batch() for _ in range(STEPS)]
        self.labelled_batches = [batch() for _ in range(STEPS // 2)]

    def labelled(self):
        def cycle(loader):
            while True:
                for data in loader:
                    yield data
        return cycle(self.labelled_batches)

    def __iter__(self):
        return iter(self.train)


@pytest.mark.parametrize("norm", [None, "batch"])
@pytest.mark.parametrize("check", checks())
def test_jem_with_sgld_samples_and_a_replay_buffer(check, norm):
    args = make_args(norm)
    buffers = []

    def data(model):
        cifar = Cifar(args)
        buffers.append(cifar)
        return cifar
    compare(lambda: get_model(args), jem_hand, JEM, data, check, steps=STEPS)
    hand, watched, port = (d.buffer for d in buffers)
    assert torch.equal(watched, hand) and torch.equal(port, hand), "the replay buffers differ"
