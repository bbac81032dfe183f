"""Steps that take gradients inside the step: MAML's inner loop, SAM's two passes, a physics-informed
net's derivatives with respect to its inputs, an adversarial example's gradient."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import Trainer

from .harness import bn_classifier, checks, compare, fixed, labelled


# -- MAML: dragen1860/MAML-Pytorch, meta.py (Meta.forward) and learner.py (functional net, BatchNorm) ------
UPDATE_LR, UPDATE_STEP, N_WAY = 0.4, 2, 3


class Learner(nn.Module):
    """A functional net as in learner.py: weights in ``vars``, BatchNorm statistics in ``vars_bn``
    (parameters without gradient, updated in place by every forward)."""

    def __init__(self):
        super().__init__()
        self.vars = nn.ParameterList([nn.Parameter(torch.randn(8, 4) * 0.5), nn.Parameter(torch.zeros(8)),
                                      nn.Parameter(torch.ones(8)), nn.Parameter(torch.zeros(8)),
                                      nn.Parameter(torch.randn(N_WAY, 8) * 0.5), nn.Parameter(torch.zeros(N_WAY))])
        self.vars_bn = nn.ParameterList([nn.Parameter(torch.zeros(8), requires_grad=False),
                                         nn.Parameter(torch.ones(8), requires_grad=False)])

    def forward(self, x, vars=None, bn_training=True):
        w1, b1, bn_w, bn_b, w2, b2 = self.vars if vars is None else vars
        running_mean, running_var = self.vars_bn
        x = F.linear(x, w1, b1)
        x = F.batch_norm(x, running_mean, running_var, weight=bn_w, bias=bn_b, training=bn_training)
        return F.linear(F.relu(x, inplace=True), w2, b2)

    def parameters(self):
        return self.vars


def maml_query_loss(net, x_spt, y_spt, x_qry, y_qry):
    """Meta.forward up to the meta update (accuracy bookkeeping kept: its no_grad forwards move BatchNorm)."""
    task_num = x_spt.size(0)
    losses_q = [0 for _ in range(UPDATE_STEP + 1)]
    for i in range(task_num):
        loss = F.cross_entropy(net(x_spt[i], vars=None, bn_training=True), y_spt[i])
        grad = torch.autograd.grad(loss, net.parameters())
        fast_weights = list(map(lambda p: p[1] - UPDATE_LR * p[0], zip(grad, net.parameters())))
        with torch.no_grad():
            losses_q[0] += F.cross_entropy(net(x_qry[i], net.parameters(), bn_training=True), y_qry[i])
        with torch.no_grad():
            losses_q[1] += F.cross_entropy(net(x_qry[i], fast_weights, bn_training=True), y_qry[i])
        for k in range(1, UPDATE_STEP):
            loss = F.cross_entropy(net(x_spt[i], fast_weights, bn_training=True), y_spt[i])
            grad = torch.autograd.grad(loss, fast_weights)
            fast_weights = list(map(lambda p: p[1] - UPDATE_LR * p[0], zip(grad, fast_weights)))
            loss_q = F.cross_entropy(net(x_qry[i], fast_weights, bn_training=True), y_qry[i])
            losses_q[k + 1] += loss_q
        losses_q.append(loss_q)  # as the source: the meta loss below is the last task's
    return losses_q[-1] / task_num


def maml_hand(net, data):
    meta_optim = torch.optim.Adam(net.parameters(), lr=0.01)
    for batch in data:
        loss_q = maml_query_loss(net, *batch)
        meta_optim.zero_grad()
        loss_q.backward()
        meta_optim.step()


class MAML(Trainer):
    def training_step(self, batch):
        return maml_query_loss(self.model, *batch)


def tasks(n):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 6, 4, generator=gen), torch.randint(N_WAY, (2, 6), generator=gen),
             torch.randn(2, 6, 4, generator=gen), torch.randint(N_WAY, (2, 6), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("check", checks())
def test_maml(check):
    compare(Learner, maml_hand, MAML, fixed(tasks(4)), check, steps=4,
            optimizer=lambda p: torch.optim.Adam(p, lr=0.01))


# -- SAM: davda54/sam, sam.py, example/train.py, example/utility/bypass_bn.py,
#    example/model/smooth_cross_entropy.py --------------------------------------------------------------
class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_((torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p))  # "w + e(w)"
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # back to "w" from "w + e(w)"
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        closure = torch.enable_grad()(closure)
        self.first_step(zero_grad=True)
        closure()
        self.second_step()

    def _grad_norm(self):
        return torch.norm(torch.stack([((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2)
                                       for group in self.param_groups for p in group["params"]
                                       if p.grad is not None]), p=2)


def disable_running_stats(model):
    def _disable(module):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.backup_momentum = module.momentum
            module.momentum = 0
    model.apply(_disable)


def enable_running_stats(model):
    def _enable(module):
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and hasattr(module, "backup_momentum"):
            module.momentum = module.backup_momentum
    model.apply(_enable)


def smooth_crossentropy(pred, gold, smoothing=0.1):
    n_class = pred.size(1)
    one_hot = torch.full_like(pred, fill_value=smoothing / (n_class - 1))
    one_hot.scatter_(dim=1, index=gold.unsqueeze(1), value=1.0 - smoothing)
    return F.kl_div(input=F.log_softmax(pred, dim=1), target=one_hot, reduction="none").sum(-1)


def sam_optimizer(params):
    return SAM(params, torch.optim.SGD, rho=2.0, adaptive=True, lr=0.1, momentum=0.9, weight_decay=0.0005)


def sam_hand(model, data):
    optimizer = sam_optimizer(model.parameters())
    for inputs, targets in data:
        enable_running_stats(model)  # first forward-backward step
        loss = smooth_crossentropy(model(inputs), targets)
        loss.mean().backward()
        optimizer.first_step(zero_grad=True)
        disable_running_stats(model)  # second forward-backward step
        smooth_crossentropy(model(inputs), targets).mean().backward()
        optimizer.second_step(zero_grad=True)


class SharpnessAware(Trainer):
    """``self.step()`` runs ``optimizer.step()`` without a closure, which SAM refuses: the port calls
    SAM's two half-steps itself."""

    automatic = False

    def training_step(self, batch):
        inputs, targets = batch
        optimizer = self.optimizers["optimizer"]
        enable_running_stats(self.model)
        loss = smooth_crossentropy(self.model(inputs), targets)
        self.backward(loss.mean())
        optimizer.first_step(zero_grad=True)
        disable_running_stats(self.model)
        self.backward(smooth_crossentropy(self.model(inputs), targets).mean())
        optimizer.second_step(zero_grad=True)
        return loss.mean()


@pytest.mark.parametrize("check", checks())
def test_sharpness_aware_minimization(check):
    compare(bn_classifier, sam_hand, SharpnessAware, fixed(labelled(5)), check, steps=5, optimizer=sam_optimizer)


# -- a physics-informed net (Burgers, discovering lambda_1 and lambda_2): jayroxis/PINNs,
#    "Burgers Equation/Burgers Identification (PyTorch).ipynb", a port of maziarraissi/PINNs ---------------
def burgers_points():
    rng = np.random.default_rng(1234)
    X = np.hstack([rng.uniform(-1, 1, (32, 1)), rng.uniform(0, 1, (32, 1))])
    return X, np.sin(np.pi * X[:, 0:1]) * np.exp(-X[:, 1:2])


class DNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.lambda_1 = nn.Parameter(torch.tensor([0.0]))
        self.lambda_2 = nn.Parameter(torch.tensor([-6.0]))

    def forward(self, x):
        return self.layers(x)


class PhysicsInformed:
    """The source's PhysicsInformedNN: the data points become tensors that require grad (float64
    arrays, so `.float()` puts a copy node over the leaf), made once, before training."""

    def __init__(self, dnn, X, u):
        self.x = torch.tensor(X[:, 0:1], requires_grad=True).float()
        self.t = torch.tensor(X[:, 1:2], requires_grad=True).float()
        self.u = torch.tensor(u).float()
        self.dnn = dnn

    def net_u(self, x, t):
        return self.dnn(torch.cat([x, t], dim=1))

    def net_f(self, x, t):
        lambda_1, lambda_2 = self.dnn.lambda_1, torch.exp(self.dnn.lambda_2)
        u = self.net_u(x, t)
        u_t = torch.autograd.grad(u, t, grad_outputs=torch.ones_like(u), retain_graph=True, create_graph=True)[0]
        u_x = torch.autograd.grad(u, x, grad_outputs=torch.ones_like(u), retain_graph=True, create_graph=True)[0]
        u_xx = torch.autograd.grad(u_x, x, grad_outputs=torch.ones_like(u_x), retain_graph=True, create_graph=True)[0]
        return u_t + lambda_1 * u * u_x - lambda_2 * u_xx

    def loss(self):
        u_pred = self.net_u(self.x, self.t)
        f_pred = self.net_f(self.x, self.t)
        return torch.mean((self.u - u_pred) ** 2) + torch.mean(f_pred ** 2)


def pinn_hand(dnn, iterations):
    pinn = PhysicsInformed(dnn, *burgers_points())
    optimizer_Adam = torch.optim.Adam(dnn.parameters())
    dnn.train()
    for _ in iterations:
        loss = pinn.loss()
        optimizer_Adam.zero_grad()
        loss.backward()
        optimizer_Adam.step()


class PINN(Trainer):
    """The points live on the Trainer, as on the source's class; a batch is only an iteration number."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pinn = PhysicsInformed(self.model, *burgers_points())

    def training_step(self, iteration):
        return self.pinn.loss()


@pytest.mark.parametrize("check", checks())
def test_physics_informed_net(check):
    compare(DNN, pinn_hand, PINN, fixed(range(5)), check, steps=5, optimizer=torch.optim.Adam)


# -- FGSM adversarial training: locuslab/fast_adversarial, CIFAR10/train_fgsm.py (delta_init=random) -------
EPSILON, ALPHA, LOWER, UPPER = 0.3, 0.375, -2.0, 2.0


def clamp(X, lower_limit, upper_limit):
    return torch.max(torch.min(X, upper_limit), lower_limit)


def fgsm_opt(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=5e-4)


def cyclic(opt):
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.0, max_lr=0.2, step_size_up=3, step_size_down=3)


def random_delta(X):
    delta = torch.zeros_like(X)
    delta.uniform_(-EPSILON, EPSILON)
    delta.data = clamp(delta, LOWER - X, UPPER - X)
    delta.requires_grad = True
    return delta


def fgsm_hand(model, data):
    opt = fgsm_opt(model.parameters())
    scheduler = cyclic(opt)
    for X, y in data:
        delta = random_delta(X)
        output = model(X + delta[:X.size(0)])
        loss = F.cross_entropy(output, y)
        loss.backward()  # also leaves gradient on the model, cleared below
        grad = delta.grad.detach()
        delta.data = clamp(delta + ALPHA * torch.sign(grad), torch.tensor(-EPSILON), torch.tensor(EPSILON))
        delta.data[:X.size(0)] = clamp(delta[:X.size(0)], LOWER - X, UPPER - X)
        delta = delta.detach()
        output = model(X + delta[:X.size(0)])
        loss = nn.CrossEntropyLoss()(output, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        scheduler.step()


class FGSM(Trainer):
    """The attack's gradient is taken with ``torch.autograd.grad``: a backward inside an automatic
    step would add the attack's gradient to the model's."""

    def training_step(self, batch):
        X, y = batch
        delta = random_delta(X)
        loss = F.cross_entropy(self.model(X + delta[:X.size(0)]), y)
        grad = torch.autograd.grad(loss, delta)[0].detach()
        delta.data = clamp(delta + ALPHA * torch.sign(grad), torch.tensor(-EPSILON), torch.tensor(EPSILON))
        delta.data[:X.size(0)] = clamp(delta[:X.size(0)], LOWER - X, UPPER - X)
        delta = delta.detach()
        return nn.CrossEntropyLoss()(self.model(X + delta[:X.size(0)]), y)


@pytest.mark.parametrize("check", checks())
def test_fgsm_adversarial_training(check):
    compare(bn_classifier, fgsm_hand, FGSM, fixed(labelled(5)), check, steps=5, optimizer=fgsm_opt,
            scheduler=cyclic)
