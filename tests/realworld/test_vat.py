"""Virtual adversarial training: lyakaap/VAT-pytorch (75a3974887dc340eaf200f4715134eb882127b9c), ``vat.py``
(``VATLoss``, ``_l2_normalize``, ``_disable_tracking_bn_stats``, verbatim) and ``train_CIFAR10.py`` (``Net``,
``train``), with the README's loop.

Each step, before the classification forward, ``VATLoss`` finds the adversarial direction on the unlabelled batch:

- the model's prediction under ``no_grad``; a random unit direction ``d`` (``torch.rand``, normalized in place);
- BatchNorm's statistics switched off by flipping every layer's ``track_running_stats`` (a context manager);
- ``d.requires_grad_()``, a forward at ``x + xi * d``, and ``adv_distance.backward()``: a plain backward, which
  writes gradient into the model's parameters as well as ``d.grad``; ``d`` becomes ``d.grad`` normalized in place,
  and ``model.zero_grad()`` drops the parameters' gradient;
- the LDS loss at ``x + eps * d`` (``d`` a leaf without grad by then), added to the cross-entropy of the labelled
  batch; one backward, one SGD step.

Changes for a seconds-long test: ``Net``'s widths 64, 128, 128 cut to 8, 16, 16, on 24-pixel images (32), batches
of 4 (32), 6 iterations (10000); the labelled and unlabelled iterators cycle over 3 and 2 fixed batches (CIFAR-10
through ``InfiniteSampler``); the meters, prints and test left out. The source's ``Net`` has no BatchNorm, so
``_disable_tracking_bn_stats`` changes nothing there: a second case puts a BatchNorm after each convolution
(an addition, to exercise it).

Under ``grad_accum=2`` the same ``training_step`` is wrong: ``model.zero_grad()`` inside the second micro-batch drops
the gradient the Trainer's backward of the first one left, so each update would be the last micro-batch's gradient
alone (divided by 2). The Trainer finds those gradients gone before the second micro-batch's backward: a
``StepError`` naming them and the fix, the parameters unchanged.
"""
import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from safeloop import StepError, Trainer

from .harness import checks, compare

args = SimpleNamespace(iters=6, lr=0.01, momentum=0.9, alpha=1.0, xi=10.0, eps=1.0, ip=1)


# -- vat.py -------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _disable_tracking_bn_stats(model):

    def switch_attr(m):
        if hasattr(m, 'track_running_stats'):
            m.track_running_stats ^= True

    model.apply(switch_attr)
    yield
    model.apply(switch_attr)


def _l2_normalize(d):
    d_reshaped = d.view(d.shape[0], -1, *(1 for _ in range(d.dim() - 2)))
    d /= torch.norm(d_reshaped, dim=1, keepdim=True) + 1e-8
    return d


class VATLoss(nn.Module):

    def __init__(self, xi=10.0, eps=1.0, ip=1):
        """VAT loss
        :param xi: hyperparameter of VAT (default: 10.0)
        :param eps: hyperparameter of VAT (default: 1.0)
        :param ip: iteration times of computing adv noise (default: 1)
        """
        super(VATLoss, self).__init__()
        self.xi = xi
        self.eps = eps
        self.ip = ip

    def forward(self, model, x):
        with torch.no_grad():
            pred = F.softmax(model(x), dim=1)

        # prepare random unit tensor
        d = torch.rand(x.shape).sub(0.5).to(x.device)
        d = _l2_normalize(d)

        with _disable_tracking_bn_stats(model):
            # calc adversarial direction
            for _ in range(self.ip):
                d.requires_grad_()
                pred_hat = model(x + self.xi * d)
                logp_hat = F.log_softmax(pred_hat, dim=1)
                adv_distance = F.kl_div(logp_hat, pred, reduction='batchmean')
                adv_distance.backward()
                d = _l2_normalize(d.grad)
                model.zero_grad()

            # calc LDS
            r_adv = d * self.eps
            pred_hat = model(x + r_adv)
            logp_hat = F.log_softmax(pred_hat, dim=1)
            lds = F.kl_div(logp_hat, pred, reduction='batchmean')

        return lds


# -- train_CIFAR10.py ---------------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self, bn=False):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=5)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=3)
        self.conv3 = nn.Conv2d(16, 16, kernel_size=3)
        self.fc1 = nn.Linear(16, 10)
        # the second case's addition: a BatchNorm after each convolution
        norm = (lambda c: nn.BatchNorm2d(c)) if bn else (lambda c: nn.Identity())
        self.bn1, self.bn2, self.bn3 = norm(8), norm(16), norm(16)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.bn1(self.conv1(x)), 2))
        x = F.relu(F.max_pool2d(self.bn2(self.conv2(x)), 2))
        x = F.relu(F.max_pool2d(self.bn3(self.conv3(x)), 2))
        x = F.adaptive_avg_pool2d(x, 1)
        x = x.view(-1, 16)
        x = self.fc1(x)
        return x


def train(args, model, device, data_iterators, optimizer):
    model.train()
    for i in range(args.iters):

        x_l, y_l = next(data_iterators['labeled'])
        x_ul, _ = next(data_iterators['unlabeled'])

        x_l, y_l = x_l.to(device), y_l.to(device)
        x_ul = x_ul.to(device)

        optimizer.zero_grad()

        vat_loss = VATLoss(xi=args.xi, eps=args.eps, ip=args.ip)
        cross_entropy = nn.CrossEntropyLoss()

        lds = vat_loss(model, x_ul)
        output = model(x_l)
        classification_loss = cross_entropy(output, y_l)
        loss = classification_loss + args.alpha * lds
        loss.backward()
        optimizer.step()


def make_optimizer(params):
    return optim.SGD(params, lr=args.lr, momentum=args.momentum)


def vat_hand(model, data):
    device = torch.device('cpu')
    optimizer = make_optimizer(model.parameters())
    train(args, model, device, data.iterators(), optimizer)


class Cifar:
    """The two cycled iterators of ``data_utils.get_iters`` (``iterators()``), and for the Trainer the same
    batches in the same order, a (labelled, unlabelled) pair each step."""

    def __init__(self):
        gen = torch.Generator().manual_seed(7)

        def batch():
            return torch.randn(4, 3, 24, 24, generator=gen), torch.randint(10, (4,), generator=gen)
        self.labeled, self.unlabeled = [batch() for _ in range(3)], [batch() for _ in range(2)]

    def iterators(self):
        return {'labeled': itertools.cycle(self.labeled), 'unlabeled': itertools.cycle(self.unlabeled)}

    def __iter__(self):
        its = self.iterators()
        return ((next(its['labeled']), next(its['unlabeled'])) for _ in range(args.iters))

    def __len__(self):
        return args.iters


class VAT(Trainer):
    def configure_optimizers(self):
        return make_optimizer(self.model.parameters())

    def training_step(self, batch):
        (x_l, y_l), (x_ul, _) = batch
        vat_loss = VATLoss(xi=args.xi, eps=args.eps, ip=args.ip)
        cross_entropy = nn.CrossEntropyLoss()

        lds = vat_loss(self.model, x_ul)
        output = self.model(x_l)
        classification_loss = cross_entropy(output, y_l)
        return classification_loss + args.alpha * lds


class ManualVAT(VAT):
    """Manual mode: the direction's backward runs outside ``self.backward``, which then finds the parameters'
    gradient dropped by ``model.zero_grad()`` (nothing to add to)."""
    automatic = False

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.backward(loss)
        self.step()
        return loss


@pytest.mark.parametrize("port", [VAT, ManualVAT])
@pytest.mark.parametrize("bn", [False, True])
@pytest.mark.parametrize("check", checks())
def test_vat_with_a_plain_backward_for_the_adversarial_direction(check, bn, port):
    compare(lambda: Net(bn), vat_hand, port, lambda model: Cifar(), check, steps=args.iters)


@pytest.mark.parametrize("check", ["auto", "always"])
def test_vat_under_gradient_accumulation_is_refused_not_silently_the_last_micro_batch(check):
    torch.manual_seed(0)
    model = Net(True)
    before = [p.detach().clone() for p in model.parameters()]  # (buffers a failed forward moved are not undone)
    torch.manual_seed(1)
    trainer = VAT(model=model, train_data=Cifar(), max_steps=2, grad_accum=2, device="cpu", progress=False,
                  loggers=(), guard={"check": check})
    with pytest.raises(StepError, match=r"step 1: under gradient accumulation, the gradients this update's earlier "
                                        r"micro-batches left \(`self.model.conv1.weight`, .* were cleared in "
                                        r"training_step .*torch.autograd.grad\(loss, \[x\]\)"):
        trainer.fit()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
