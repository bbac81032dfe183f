"""Hand-written training loops from public code, run three times from the same seeds: bare, under
``python -m safeloop.watch``'s guard (``Watch``, in process) and with ``safeloop.GraphGuard`` written into the
loop (``with guard.step():`` and ``guard.backward(loss)``). Every parameter and buffer (and what the loop keeps:
an EMA model, a running mean of the losses) must come out bit for bit the same, with no warning and no error, in
every guard mode; where the source's classic mistake is made, the guard must stop it naming the tensor.

The loops take ``guard=None``: given a ``GraphGuard``, ``step`` is its ``step`` and ``backward`` its ``backward``;
otherwise a null context and ``Tensor.backward`` (looked up when the loop runs, so that under ``Watch`` it is the
watched one, called from the loop's own frame as the source calls it).
"""
import contextlib
import functools
import math
import re
import warnings
from collections import namedtuple
from copy import deepcopy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import GraphGuard
from safeloop.errors import (DoubleBackwardError, GraphLeakWarning, GraphReuseError,
                             InplaceModificationError)
from safeloop.watch import Watch

from .harness import assert_same, checks, strict


def hooks(guard):
    """(step, backward) of a loop: the guard's, or a null context and ``Tensor.backward``."""
    if guard is None:
        return contextlib.nullcontext, torch.Tensor.backward
    return guard.step, guard.backward


def same(ours, ref) -> None:
    for a, b in zip(ours, ref, strict=True):
        if isinstance(a, nn.Module):
            assert_same(a, b)
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b


def three_runs(build, loop, check):
    """``loop(*build())`` bare, under ``Watch`` and with a ``GraphGuard``, each from the same seeds; what each
    returns (modules, tensors, numbers) compared with the bare run's, bit for bit. Returns the bare run's
    result and a copy of its first module before training."""
    def run(guard=None, watch=None):
        torch.manual_seed(0)
        np.random.seed(0)
        built = build()
        start = deepcopy(built[0])
        torch.manual_seed(1)
        np.random.seed(1)
        with watch or contextlib.nullcontext():
            return loop(*built, guard=guard), start
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref, start = run()
    with strict(own):
        watched, _ = run(watch=Watch(GraphGuard(check=check), loop.__code__.co_filename))
    same(watched, ref)
    with strict(own):
        guarded, _ = run(guard=GraphGuard(check=check))
    same(guarded, ref)
    assert any(not torch.equal(p, q) for p, q in zip(ref[0].parameters(), start.parameters())), "nothing trained"
    return ref


def watched(loop, *args, check="always"):
    """``loop(*args)`` under ``Watch``."""
    with Watch(GraphGuard(check=check), loop.__code__.co_filename):
        return loop(*args)


# -- ultralytics/yolov5: train.py (v6), utils/torch_utils.py (ModelEMA), utils/loss.py (ComputeLoss) ----------
YOLO_HYP = {'lr0': 0.01, 'lrf': 0.01, 'momentum': 0.937, 'weight_decay': 0.0005, 'warmup_epochs': 1.0,
            'warmup_momentum': 0.8, 'warmup_bias_lr': 0.1, 'box': 0.05, 'cls': 0.5, 'obj': 1.0}
NC = 3


class ModelEMA:
    """ Model Exponential Moving Average from https://github.com/rwightman/pytorch-image-models """

    def __init__(self, model, decay=0.9999, updates=0):
        # Create EMA
        self.ema = deepcopy(model).eval()  # FP32 EMA
        self.updates = updates  # number of EMA updates
        self.decay = lambda x: decay * (1 - math.exp(-x / 2000))  # decay exponential ramp (to help early epochs)
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        # Update EMA parameters
        with torch.no_grad():
            self.updates += 1
            d = self.decay(self.updates)

            msd = model.state_dict()  # model state_dict
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= d
                    v += (1. - d) * msd[k].detach()


def yolo_model():
    """A two-convolution stand-in for the detector: per cell 2 box offsets, 1 objectness, NC class logits."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.SiLU(),
                         nn.Conv2d(4, 3 + NC, 1))


class ComputeLoss:
    """ComputeLoss.__call__'s shape: three (1,)-shaped sums, the loss scaled by the batch size, the items
    detached for logging (``detach_items=False``: the mistake of logging them with their graph)."""

    def __init__(self, detach_items=True):
        self.BCEcls = nn.BCEWithLogitsLoss()
        self.BCEobj = nn.BCEWithLogitsLoss()
        self.detach_items = detach_items

    def __call__(self, p, targets):
        lcls, lbox, lobj = torch.zeros(1), torch.zeros(1), torch.zeros(1)
        tbox, tobj, tcls = targets
        lbox += (p[:, :2] - tbox).pow(2).mean()
        lobj += self.BCEobj(p[:, 2], tobj)
        lcls += self.BCEcls(p[:, 3:], tcls)
        lbox *= YOLO_HYP['box']
        lobj *= YOLO_HYP['obj']
        lcls *= YOLO_HYP['cls']
        bs = tobj.shape[0]  # batch size
        items = torch.cat((lbox, lobj, lcls))
        return (lbox + lobj + lcls) * bs, items.detach() if self.detach_items else items


def yolo_build(detach_items=True, n=4):
    model = yolo_model()
    gen = torch.Generator().manual_seed(3)
    loader = [(torch.rand(2, 3, 4, 4, generator=gen),
               (torch.randn(2, 2, 4, 4, generator=gen), torch.rand(2, 4, 4, generator=gen).round(),
                torch.rand(2, NC, 4, 4, generator=gen).round())) for _ in range(n)]
    return model, loader, ComputeLoss(detach_items)


def yolo_train(model, train_loader, compute_loss, epochs=2, batch_size=2, nbs=8, guard=None):
    step, backward = hooks(guard)
    hyp = YOLO_HYP
    g0, g1, g2 = [], [], []  # optimizer parameter groups
    for v in model.modules():
        if hasattr(v, 'bias') and isinstance(v.bias, nn.Parameter):  # bias
            g2.append(v.bias)
        if isinstance(v, nn.BatchNorm2d):  # weight (no decay)
            g0.append(v.weight)
        elif hasattr(v, 'weight') and isinstance(v.weight, nn.Parameter):  # weight (with decay)
            g1.append(v.weight)
    optimizer = torch.optim.SGD(g0, lr=hyp['lr0'], momentum=hyp['momentum'], nesterov=True)
    optimizer.add_param_group({'params': g1, 'weight_decay': hyp['weight_decay']})  # add g1 with weight_decay
    optimizer.add_param_group({'params': g2})  # add g2 (biases)
    lf = lambda x: (1 - x / epochs) * (1.0 - hyp['lrf']) + hyp['lrf']  # noqa: E731 (linear)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model)
    nb = len(train_loader)  # number of batches
    nw = max(round(hyp['warmup_epochs'] * nb), 3)  # number of warmup iterations (100 in the source)
    last_opt_step = -1
    scheduler.last_epoch = -1  # do not move
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # amp = cuda in the source
    for epoch in range(epochs):
        model.train()
        mloss = torch.zeros(3)  # mean losses
        optimizer.zero_grad()
        for i, (imgs, targets) in enumerate(train_loader):
            with step():
                ni = i + nb * epoch  # number integrated batches (since train start)
                # Warmup
                if ni <= nw:
                    xi = [0, nw]  # x interp
                    accumulate = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
                    for j, x in enumerate(optimizer.param_groups):
                        # bias lr falls from 0.1 to lr0, all other lrs rise from 0.0 to lr0
                        x['lr'] = np.interp(ni, xi, [hyp['warmup_bias_lr'] if j == 2 else 0.0,
                                                     x['initial_lr'] * lf(epoch)])
                        if 'momentum' in x:
                            x['momentum'] = np.interp(ni, xi, [hyp['warmup_momentum'], hyp['momentum']])
                # Forward
                with torch.autocast("cpu", enabled=False):
                    pred = model(imgs)  # forward
                    loss, loss_items = compute_loss(pred, targets)  # loss scaled by batch_size
                # Backward
                backward(scaler.scale(loss))
                # Optimize
                if ni - last_opt_step >= accumulate:
                    scaler.step(optimizer)  # optimizer.step
                    scaler.update()
                    optimizer.zero_grad()
                    if ema:
                        ema.update(model)
                    last_opt_step = ni
                # Log
                mloss = (mloss * i + loss_items) / (i + 1)  # update mean losses
        scheduler.step()
    return model, ema.ema, mloss.detach(), ema.updates


@pytest.mark.parametrize("check", checks())
def test_yolov5_accumulation_with_model_ema_and_a_running_mean_of_detached_losses(check):
    """ultralytics/yolov5, train.py (v6) and utils/torch_utils.py (``ModelEMA``): a warm-up that grows
    ``accumulate`` (an update when ``ni - last_opt_step >= accumulate``, so backwards of several iterations
    before one step), ``ModelEMA.update`` writing the EMA's state in place under ``no_grad`` (BatchNorm's
    buffers too), and ``mloss`` kept as a tensor from the loss items ComputeLoss detaches."""
    model, ema, mloss, updates = three_runs(yolo_build, yolo_train, check)
    assert 2 < updates < 8  # accumulation happened: fewer updates than batches
    assert not torch.equal(ema.state_dict()["1.running_mean"], torch.zeros(4))
    assert mloss.grad_fn is None


def test_yolov5_loss_items_logged_with_their_graph_are_named():
    """The same loop with ComputeLoss's ``.detach()`` left out of the loss items: ``mloss``, a running mean
    kept across iterations, then holds every iteration's graph. The guard names ``mloss`` (epochs of 8 batches:
    under ``watch`` a step ends at each update, and ``mloss`` must outlive two of them)."""
    torch.manual_seed(0)
    model, loader, compute_loss = yolo_build(detach_items=False, n=8)
    with pytest.warns(GraphLeakWarning, match=r"mloss"):
        watched(yolo_train, model, loader, compute_loss)
    torch.manual_seed(0)
    model, loader, compute_loss = yolo_build(detach_items=False, n=8)
    with pytest.warns(GraphLeakWarning, match=r"mloss"):
        yolo_train(model, loader, compute_loss, guard=GraphGuard(check="always"))


# -- pytorch/examples: fast_neural_style/neural_style/{neural_style,vgg,utils,transformer_net}.py -------------
class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super(ConvLayer, self).__init__()
        reflection_padding = kernel_size // 2
        self.reflection_pad = nn.ReflectionPad2d(reflection_padding)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        out = self.reflection_pad(x)
        out = self.conv2d(out)
        return out


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super(ResidualBlock, self).__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = nn.InstanceNorm2d(channels, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x):
        residual = x
        out = self.relu(self.in1(self.conv1(x)))
        out = self.in2(self.conv2(out))
        out = out + residual
        return out


class TransformerNet(nn.Module):
    """TransformerNet with 4 channels (32, 64, 128) and one residual block (five), no down/upsampling."""

    def __init__(self):
        super(TransformerNet, self).__init__()
        self.conv1 = ConvLayer(3, 4, kernel_size=3, stride=1)
        self.in1 = nn.InstanceNorm2d(4, affine=True)
        self.res1 = ResidualBlock(4)
        self.deconv3 = ConvLayer(4, 3, kernel_size=3, stride=1)
        self.relu = nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.res1(y)
        y = self.deconv3(y)
        return y


class Vgg16(nn.Module):
    """Vgg16's four slices and its ``requires_grad`` switch, over 3x3 convolutions of 4 channels."""

    def __init__(self, requires_grad=False):
        super(Vgg16, self).__init__()
        self.slice1 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.slice2 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.slice3 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.slice4 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        if not requires_grad:
            for param in self.parameters():
                param.requires_grad = False

    def forward(self, X):
        h = self.slice1(X)
        h_relu1_2 = h
        h = self.slice2(h)
        h_relu2_2 = h
        h = self.slice3(h)
        h_relu3_3 = h
        h = self.slice4(h)
        h_relu4_3 = h
        vgg_outputs = namedtuple("VggOutputs", ['relu1_2', 'relu2_2', 'relu3_3', 'relu4_3'])
        out = vgg_outputs(h_relu1_2, h_relu2_2, h_relu3_3, h_relu4_3)
        return out


def gram_matrix(y):
    (b, ch, h, w) = y.size()
    features = y.view(b, ch, w * h)
    features_t = features.transpose(1, 2)
    gram = features.bmm(features_t) / (ch * h * w)
    return gram


def normalize_batch(batch):
    # normalize using imagenet mean and std
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    batch = batch.div_(255.0)
    return (batch - mean) / std


def style_build(vgg_requires_grad=False):
    transformer = TransformerNet()
    vgg = Vgg16(requires_grad=vgg_requires_grad)
    gen = torch.Generator().manual_seed(5)
    train_loader = [(torch.rand(2, 3, 8, 8, generator=gen) * 255, None) for _ in range(4)]  # made anew: div_
    style = torch.rand(3, 8, 8, generator=gen) * 255
    return transformer, vgg, train_loader, style


def style_train(transformer, vgg, train_loader, style, epochs=1, batch_size=2, content_weight=1e5,
                style_weight=1e10, guard=None):
    step, backward = hooks(guard)
    optimizer = torch.optim.Adam(transformer.parameters(), 1e-3)
    mse_loss = torch.nn.MSELoss()
    style = style.repeat(batch_size, 1, 1, 1)
    features_style = vgg(normalize_batch(style))
    gram_style = [gram_matrix(y) for y in features_style]
    for e in range(epochs):
        transformer.train()
        agg_content_loss = 0.
        agg_style_loss = 0.
        count = 0
        for batch_id, (x, _) in enumerate(train_loader):
            with step():
                n_batch = len(x)
                count += n_batch
                optimizer.zero_grad()

                y = transformer(x)

                y = normalize_batch(y)
                x = normalize_batch(x)

                features_y = vgg(y)
                features_x = vgg(x)

                content_loss = content_weight * mse_loss(features_y.relu2_2, features_x.relu2_2)

                style_loss = 0.
                for ft_y, gm_s in zip(features_y, gram_style):
                    gm_y = gram_matrix(ft_y)
                    style_loss += mse_loss(gm_y, gm_s[:n_batch, :, :])
                style_loss *= style_weight

                total_loss = content_loss + style_loss
                backward(total_loss)
                optimizer.step()

                agg_content_loss += content_loss.item()
                agg_style_loss += style_loss.item()
    return transformer, vgg, agg_content_loss, agg_style_loss


@pytest.mark.parametrize("check", checks())
def test_fast_neural_style_with_a_frozen_vgg_and_gram_matrices_computed_once(check):
    """pytorch/examples, fast_neural_style/neural_style/neural_style.py (``train``), vgg.py (``Vgg16``),
    utils.py (``gram_matrix``, ``normalize_batch``: an in-place ``div_`` on the transformer's output) and
    transformer_net.py: the style's Gram matrices computed once before the loop through a VGG whose
    parameters do not require grad (no graph), reused by every step's style loss."""
    three_runs(style_build, style_train, check)


def trainable_vgg_stopped(run):
    """``run(*built)`` on a style loop with ``Vgg16(requires_grad=True)`` raises the guard's error at step 1, before
    any update, naming ``gram_style``; VGG is in no optimizer, so the first fix keeps the targets constants, the whole
    list at once (each of its Gram matrices keeps a graph)."""
    torch.manual_seed(0)
    transformer, *rest = built = style_build(vgg_requires_grad=True)
    start = deepcopy(transformer)
    with pytest.raises(GraphReuseError, match=r"built before the step is reused \(step 1, .*`local gram_style\[3\]`.*"
                                              r"To fix: if it is meant as a constant \(no gradient through it into "
                                              r"`vgg\..*store `\[t.detach\(\) for t in gram_style\]` instead, or "
                                              r"compute it under `torch.no_grad\(\)`; or recompute `gram_style` "
                                              r"inside the loop"):
        run(*built)
    assert_same(transformer, start)


def test_fast_neural_style_with_vgg_left_trainable_names_the_gram_matrices():
    """``Vgg16(requires_grad=True)``: the Gram matrices made before the loop carry a graph every step's loss
    reaches; PyTorch fails at the second backward, ``GraphGuard`` at the first, naming ``gram_style``."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        style_train(*style_build(vgg_requires_grad=True))
    trainable_vgg_stopped(lambda *built: style_train(*built, guard=GraphGuard()))


def test_fast_neural_style_with_vgg_left_trainable_under_watch():
    """The same mistake under ``python -m safeloop.watch``: the same error as ``GraphGuard``'s, at step 1."""
    trainable_vgg_stopped(lambda *built: watched(style_train, *built, check="auto"))


def record(history: list, out: torch.Tensor) -> None:
    history.append(out)


def filled_in_the_loop(how: str) -> torch.nn.Module:
    """A list or dict made before the loop, to which each iteration adds its output before the backward that
    reaches it (by a call, ``append`` or an item stored), cleared after the update."""
    torch.manual_seed(0)
    net = nn.Linear(3, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    history, stats = [], {}
    for _ in range(3):
        opt.zero_grad()
        if how == "call":
            record(history, net(torch.randn(2, 3)))
            loss = history[-1].pow(2).mean()
        elif how == "append":
            history.append(net(torch.randn(2, 3)))
            loss = history[-1].pow(2).mean()
        else:
            stats["out"] = net(torch.randn(2, 3))
            loss = stats["out"].pow(2).mean()
        loss.backward()
        opt.step()
        history.clear()
    return net


@pytest.mark.parametrize("how", ["call", "append", "item"])
def test_a_list_the_loop_fills_before_its_backward_is_not_taken_for_one_made_before_the_loop(how):
    """The first backward under watch sees a list held from before the loop: its items this iteration added are
    this step's graph, not a graph built before the loop."""
    with strict([]):
        assert_same(watched(filled_in_the_loop, how, check="auto"), filled_in_the_loop(how))


# -- vwxyzjn/cleanrl: cleanrl/sac_continuous_action.py ---------------------------------------------------------
class LinearEnv:
    """A stand-in for gym's Hopper: 3-d observation, 1-d action in [-1, 1], episodes of 4 steps (NumPy)."""

    def __init__(self):
        rng = np.random.RandomState(7)
        self.a, self.b = rng.randn(3, 3).astype(np.float32) / 2, rng.randn(3, 1).astype(np.float32)

    def reset(self):
        self.t, self.obs = 0, np.random.randn(1, 3).astype(np.float32)
        return self.obs

    def step(self, actions):
        self.obs = np.tanh(self.obs @ self.a + actions.astype(np.float32) @ self.b.T).astype(np.float32)
        self.t += 1
        reward = (1.0 - np.abs(self.obs[:, 0])).astype(np.float32)
        done = np.array([self.t >= 4], dtype=np.float32)
        return self.obs, reward, done


class ReplayBuffer:
    def __init__(self, size=64):
        self.obs, self.next_obs = np.zeros((size, 3), np.float32), np.zeros((size, 3), np.float32)
        self.actions, self.rewards, self.dones = np.zeros((size, 1), np.float32), np.zeros(size, np.float32), \
            np.zeros(size, np.float32)
        self.pos = 0

    def add(self, obs, next_obs, actions, rewards, dones):
        self.obs[self.pos], self.next_obs[self.pos], self.actions[self.pos] = obs[0], next_obs[0], actions[0]
        self.rewards[self.pos], self.dones[self.pos] = rewards[0], dones[0]
        self.pos += 1

    def sample(self, batch_size):
        idx = np.random.randint(0, self.pos, size=batch_size)
        Batch = namedtuple("Batch", "observations actions next_observations dones rewards")
        return Batch(*(torch.from_numpy(a[idx]) for a in (self.obs, self.actions, self.next_obs, self.dones,
                                                            self.rewards)))


class SoftQNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3 + 1, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


LOG_STD_MAX = 2
LOG_STD_MIN = -5


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc_mean = nn.Linear(8, 1)
        self.fc_logstd = nn.Linear(8, 1)
        # action rescaling
        self.register_buffer("action_scale", torch.tensor([1.0]))
        self.register_buffer("action_bias", torch.tensor([0.0]))

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = self.fc_logstd(x)
        log_std = torch.tanh(log_std)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)  # From SpinUp / Denis Yarats

        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()  # for reparameterization trick (mean + std * N(0,1))
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing Action Bound
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


def sac_build():
    actor, qf1, qf2 = Actor(), SoftQNetwork(), SoftQNetwork()
    qf1_target, qf2_target = SoftQNetwork(), SoftQNetwork()
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    return actor, qf1, qf2, qf1_target, qf2_target, LinearEnv()


def sac_train(actor, qf1, qf2, qf1_target, qf2_target, envs, total_timesteps=8, learning_starts=3,
              batch_size=4, policy_frequency=2, target_network_frequency=1, tau=0.005, gamma=0.99,
              no_grad_log_pi=True, guard=None):
    step, backward = hooks(guard)
    q_optimizer = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=1e-3)
    actor_optimizer = torch.optim.Adam(list(actor.parameters()), lr=3e-4)
    # Automatic entropy tuning
    target_entropy = -torch.prod(torch.Tensor((1,))).item()
    log_alpha = torch.zeros(1, requires_grad=True)
    alpha = log_alpha.exp().item()
    a_optimizer = torch.optim.Adam([log_alpha], lr=1e-3)
    rb = ReplayBuffer()
    obs = envs.reset()
    for global_step in range(total_timesteps):
        # ALGO LOGIC: put action logic here
        if global_step < learning_starts:
            actions = np.random.uniform(-1, 1, size=(1, 1)).astype(np.float32)
        else:
            actions, _, _ = actor.get_action(torch.Tensor(obs))
            actions = actions.detach().cpu().numpy()
        next_obs, rewards, terminations = envs.step(actions)
        rb.add(obs, next_obs, actions, rewards, terminations)
        obs = envs.reset() if terminations[0] else next_obs

        # ALGO LOGIC: training.
        if global_step > learning_starts:
            with step():
                data = rb.sample(batch_size)
                with torch.no_grad():
                    next_state_actions, next_state_log_pi, _ = actor.get_action(data.next_observations)
                    qf1_next_target = qf1_target(data.next_observations, next_state_actions)
                    qf2_next_target = qf2_target(data.next_observations, next_state_actions)
                    min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
                    next_q_value = data.rewards.flatten() + (1 - data.dones.flatten()) * gamma * (
                        min_qf_next_target).view(-1)

                qf1_a_values = qf1(data.observations, data.actions).view(-1)
                qf2_a_values = qf2(data.observations, data.actions).view(-1)
                qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
                qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
                qf_loss = qf1_loss + qf2_loss

                # optimize the model
                q_optimizer.zero_grad()
                backward(qf_loss)
                q_optimizer.step()

                if global_step % policy_frequency == 0:  # TD 3 Delayed update support
                    for _ in range(policy_frequency):  # compensate for the delay
                        pi, log_pi, _ = actor.get_action(data.observations)
                        qf1_pi = qf1(data.observations, pi)
                        qf2_pi = qf2(data.observations, pi)
                        min_qf_pi = torch.min(qf1_pi, qf2_pi)
                        actor_loss = ((alpha * log_pi) - min_qf_pi).mean()

                        actor_optimizer.zero_grad()
                        backward(actor_loss)
                        actor_optimizer.step()

                        if no_grad_log_pi:
                            with torch.no_grad():
                                _, log_pi, _ = actor.get_action(data.observations)
                        alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()

                        a_optimizer.zero_grad()
                        backward(alpha_loss)
                        a_optimizer.step()
                        alpha = log_alpha.exp().item()

                # update the target networks
                if global_step % target_network_frequency == 0:
                    for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                        target_param.data.copy_(tau * param.data + (1 - tau) * target_param.data)
                    for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                        target_param.data.copy_(tau * param.data + (1 - tau) * target_param.data)
    return actor, qf1, qf2, qf1_target, qf2_target, log_alpha.detach(), alpha


@pytest.mark.parametrize("check", checks())
def test_cleanrl_sac_with_compensated_policy_delay_and_polyak_targets(check):
    """vwxyzjn/cleanrl, cleanrl/sac_continuous_action.py: q, actor and alpha optimizers; every
    ``policy_frequency``-th step the actor updated ``policy_frequency`` times on one batch (its loss leaving
    gradients on the critics), each followed by the temperature's update on ``log_pi`` recomputed under
    ``no_grad`` and ``alpha = log_alpha.exp().item()``; both target critics polyak-averaged through
    ``target_param.data.copy_``; a forward with a graph to pick the exploration action (``.detach()``)."""
    *_, log_alpha, alpha = three_runs(sac_build, sac_train, check)
    assert log_alpha.item() != 0.0 and alpha == log_alpha.exp().item()  # the temperature was tuned


SAC_LOG_PI = (r"backward through a graph that was already consumed .*`local log_pi`.*changed in place.*"
              r"retain_graph=True cannot help.*To fix: compute `log_pi` again")


def test_cleanrl_sac_alpha_loss_on_the_actors_log_pi_is_named():
    """The classic SAC mistake: ``alpha_loss`` built on the actor loss's ``log_pi`` (no recompute under
    ``no_grad``, no ``.detach()``), whose graph ``actor_loss.backward()`` freed, after which the actor's optimizer
    stepped. PyTorch raises inside the backward; ``GraphGuard`` before it, naming ``log_pi``, saying that
    ``retain_graph=True`` cannot help (the actor's weights it saved were updated) and to compute it again."""
    torch.manual_seed(0)
    np.random.seed(0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        sac_train(*sac_build(), no_grad_log_pi=False)
    torch.manual_seed(0)
    np.random.seed(0)
    with pytest.raises(DoubleBackwardError, match=SAC_LOG_PI):
        sac_train(*sac_build(), no_grad_log_pi=False, guard=GraphGuard())


def test_cleanrl_sac_alpha_loss_on_the_actors_log_pi_under_watch():
    """The same mistake under ``python -m safeloop.watch``: the same advice as ``GraphGuard``'s."""
    torch.manual_seed(0)
    np.random.seed(0)
    with Watch(GraphGuard(check="auto"), sac_train.__code__.co_filename):
        with pytest.raises(DoubleBackwardError) as raised:
            sac_train(*sac_build(), no_grad_log_pi=False)
    assert "`local log_pi`" in str(raised.value)
    if not re.search(SAC_LOG_PI, str(raised.value)):
        pytest.fail(f"misleading advice: {raised.value}")


class Accelerated:
    """A ``GraphGuard`` used as docs/guard.md shows it with Accelerate: ``guard.check(loss)``, then
    ``accelerator.backward(loss)`` (huggingface/accelerate, src/accelerate/accelerator.py: ``loss /
    gradient_accumulation_steps``, then ``loss.backward()``), one accumulation step here."""

    def __init__(self, guard, gradient_accumulation_steps=1):
        self.guard, self.gradient_accumulation_steps = guard, gradient_accumulation_steps
        self.step = guard.step

    def backward(self, loss, **kwargs):
        self.guard.check(loss)
        loss = loss / self.gradient_accumulation_steps
        loss.backward(**kwargs)


@pytest.mark.parametrize("check", ["always"])
def test_cleanrl_sac_checked_as_with_accelerate(check):
    """The SAC loop with ``guard.check(loss)`` before a backward the guard does not run (Accelerate's): the same
    parameters, and quiet."""
    def guarded(*built, guard=None):
        return sac_train(*built, guard=None if guard is None else Accelerated(guard))
    three_runs(sac_build, guarded, check)


def test_cleanrl_sac_alpha_loss_on_the_actors_log_pi_checked_as_with_accelerate():
    """The SAC mistake under the documented Accelerate pattern: ``guard.check(alpha_loss)`` stops it, as
    ``guard.backward`` does, naming ``log_pi``."""
    torch.manual_seed(0)
    np.random.seed(0)
    with pytest.raises(DoubleBackwardError, match=r"`local log_pi`"):
        sac_train(*sac_build(), no_grad_log_pi=False, guard=Accelerated(GraphGuard()))


@pytest.mark.parametrize("check", ["auto", "always"])
def test_two_losses_on_one_trunk_checked_as_with_accelerate_and_retained_stay_quiet(check):
    """``guard.check`` before each of two backwards through one trunk, the first with ``retain_graph=True`` (the
    graph is not freed), one update after both: quiet, and the same parameters as without the guard."""
    def loop(guard=None):
        torch.manual_seed(0)
        trunk, heads = nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 1), nn.Linear(4, 1)])
        opt = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
        for _ in range(3):
            with guard.step() if guard else contextlib.nullcontext():
                features = trunk(torch.randn(5, 3))
                opt.zero_grad()
                for i, head in enumerate(heads):
                    loss = head(features).pow(2).mean()
                    if guard:
                        guard.check(loss)
                    loss.backward(retain_graph=i == 0)
                opt.step()
        return trunk
    with strict([]):
        assert_same(loop(GraphGuard(check=check)), loop())


# -- huggingface/transformers: modeling_utils.py (gradient_checkpointing_enable, enable_input_require_grads),
#    models/bert/modeling_bert.py (BertSelfAttention, BertLayer, BertEncoder), examples/pytorch/
#    text-classification/run_glue_no_trainer.py (the loop) ---------------------------------------------------
class BertLayer(nn.Module):
    """One head of BertSelfAttention, BertSelfOutput, BertIntermediate and BertOutput, hidden size 8."""

    def __init__(self, hidden=8, intermediate=16, p=0.1):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), \
            nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(p)
        self.attn_out, self.attn_norm, self.attn_out_dropout = nn.Linear(hidden, hidden), nn.LayerNorm(hidden), \
            nn.Dropout(p)
        self.intermediate, self.output = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.out_norm, self.out_dropout = nn.LayerNorm(hidden), nn.Dropout(p)

    def forward(self, hidden_states, attention_mask):
        q, k, v = self.query(hidden_states), self.key(hidden_states), self.value(hidden_states)
        attention_scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        attention_scores = attention_scores + attention_mask
        attention_probs = self.attn_dropout(nn.functional.softmax(attention_scores, dim=-1))
        context = torch.matmul(attention_probs, v)
        attention_output = self.attn_norm(self.attn_out_dropout(self.attn_out(context)) + hidden_states)
        intermediate_output = F.gelu(self.intermediate(attention_output))
        layer_output = self.out_norm(self.out_dropout(self.output(intermediate_output)) + attention_output)
        return (layer_output,)


class BertClassifier(nn.Module):
    def __init__(self, vocab=12, hidden=8, layers=2, labels=2):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.layer = nn.ModuleList([BertLayer(hidden) for _ in range(layers)])
        self.classifier = nn.Linear(hidden, labels)
        self.gradient_checkpointing = False

    def get_input_embeddings(self):
        return self.word_embeddings

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        if gradient_checkpointing_kwargs is None:
            gradient_checkpointing_kwargs = {"use_reentrant": True}
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                              **gradient_checkpointing_kwargs)
        self.gradient_checkpointing = True

    def enable_input_require_grads(self):
        def make_inputs_require_grads(module, input, output):
            output.requires_grad_(True)

        self._require_grads_hook = self.get_input_embeddings().register_forward_hook(make_inputs_require_grads)

    def forward(self, input_ids, attention_mask, labels):
        hidden_states = self.word_embeddings(input_ids)
        extended_attention_mask = (1.0 - attention_mask[:, None, :]) * torch.finfo(hidden_states.dtype).min
        for i, layer_module in enumerate(self.layer):
            if self.gradient_checkpointing and self.training:
                layer_outputs = self._gradient_checkpointing_func(layer_module.__call__, hidden_states,
                                                                  extended_attention_mask)
            else:
                layer_outputs = layer_module(hidden_states, extended_attention_mask)
            hidden_states = layer_outputs[0]
        logits = self.classifier(hidden_states[:, 0])
        return nn.functional.cross_entropy(logits, labels), logits


def hf_build(use_reentrant):
    model = BertClassifier()
    model.get_input_embeddings().requires_grad_(False)  # a frozen base, as PEFT leaves it
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:  # what PEFT's prepare_model_for_kbit_training does, so that the layers get gradients
        model.enable_input_require_grads()
    gen = torch.Generator().manual_seed(6)
    batches = [{"input_ids": torch.randint(12, (2, 5), generator=gen),
                "attention_mask": torch.tensor([[1., 1., 1., 1., 1.], [1., 1., 1., 0., 0.]]),
                "labels": torch.randint(2, (2,), generator=gen)} for _ in range(4)]
    return model, batches


def hf_train(model, train_dataloader, gradient_accumulation_steps=2, guard=None):
    step_, backward = hooks(guard)
    no_decay = ["bias", "norm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay) and p.requires_grad], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay) and p.requires_grad], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=1e-2)
    num_update_steps = len(train_dataloader) // gradient_accumulation_steps
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / num_update_steps)
    model.train()
    total_loss = 0
    for step, batch in enumerate(train_dataloader):
        with step_():
            outputs = model(**batch)
            loss = outputs[0]
            total_loss += loss.detach().float()
            loss = loss / gradient_accumulation_steps
            backward(loss)
            if step % gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
    return model, total_loss


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("check", checks())
def test_hf_gradient_checkpointing_with_a_frozen_embedding(check, use_reentrant):
    """Hugging Face's gradient checkpointing as ``gradient_checkpointing_enable`` sets it up
    (``functools.partial(checkpoint, use_reentrant=...)`` around each ``layer_module.__call__``) on a model whose
    embedding is frozen: reentrant, with ``enable_input_require_grads``' forward hook making the embedding's output
    require grad (PEFT's ``prepare_model_for_kbit_training``); non-reentrant without it. Dropout inside the
    checkpointed layers (its RNG state restored for the recomputation), ``loss / gradient_accumulation_steps``,
    ``total_loss += loss.detach().float()``."""
    model, _ = three_runs(lambda: hf_build(use_reentrant), hf_train, check)
    torch.manual_seed(0)
    start, _ = hf_build(use_reentrant)
    assert not torch.equal(model.layer[0].query.weight, start.layer[0].query.weight)  # checkpointed layers trained
    assert torch.equal(model.word_embeddings.weight, start.word_embeddings.weight)


# -- vwxyzjn/cleanrl: cleanrl/c51.py -----------------------------------------------------------------------------
class QNetwork(nn.Module):
    def __init__(self, n_atoms=11, v_min=-10, v_max=10):
        super(QNetwork, self).__init__()
        self.n_atoms = n_atoms
        self.register_buffer("atoms", torch.linspace(v_min, v_max, steps=n_atoms))
        self.n = 2
        self.network = nn.Sequential(
            nn.Linear(3, 12),
            nn.ReLU(),
            nn.Linear(12, 8),
            nn.ReLU(),
            nn.Linear(8, self.n * n_atoms)
        )

    def forward(self, x):
        return self.network(x)

    def get_action(self, x, action=None):
        logits = self.forward(x)
        # probability mass function for each action
        pmfs = torch.softmax(logits.view(len(x), self.n, self.n_atoms), dim=2)
        q_values = (pmfs*self.atoms).sum(2)
        if action is None:
            action = torch.argmax(q_values, 1)
        return action, pmfs[torch.arange(len(x)), action]


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def c51_build():
    q_network, target_network = QNetwork(), QNetwork()
    target_network.load_state_dict(q_network.state_dict())
    return q_network, target_network, LinearEnv()


def c51_train(q_network, target_network, envs, total_timesteps=10, learning_starts=3, train_frequency=1,
              target_network_frequency=4, batch_size=4, gamma=0.99, n_atoms=11, v_min=-10, v_max=10,
              max_grad_norm=0.5, guard=None):
    step, backward = hooks(guard)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=2.5e-3, eps=0.01/batch_size)
    rb = ReplayBuffer()
    obs = envs.reset()
    for global_step in range(total_timesteps):
        # ALGO LOGIC: put action logic here
        epsilon = linear_schedule(1.0, 0.05, 0.5*total_timesteps, global_step)
        if np.random.random() < epsilon:
            actions = np.random.randint(2, size=(1,))
        else:
            actions, pmf = q_network.get_action(torch.Tensor(obs))
            actions = actions.cpu().numpy()
        next_obs, rewards, dones = envs.step(actions.reshape(1, 1) * 2.0 - 1.0)
        rb.add(obs, next_obs, actions.reshape(1, 1), rewards, dones)
        obs = envs.reset() if dones[0] else next_obs

        # ALGO LOGIC: training.
        if global_step > learning_starts and global_step % train_frequency == 0:
            with step():
                data = rb.sample(batch_size)

                with torch.no_grad():
                    _, next_pmfs = target_network.get_action(data.next_observations)
                    next_atoms = data.rewards[:, None] + gamma * target_network.atoms * (1 - data.dones[:, None])
                    # projection
                    delta_z = target_network.atoms[1] - target_network.atoms[0]
                    tz = next_atoms.clamp(v_min, v_max)

                    b = (tz - v_min) / delta_z
                    l = b.floor().clamp(0, n_atoms-1)  # noqa: E741
                    u = b.ceil().clamp(0, n_atoms-1)
                    # (l == u).float() handles the case where bj is exactly an integer
                    d_m_l = (u + (l == u).float() - b) * next_pmfs
                    d_m_u = (b - l) * next_pmfs
                    target_pmfs = torch.zeros_like(next_pmfs)
                    for i in range(target_pmfs.size(0)):
                        target_pmfs[i].index_add_(0, l[i].long(), d_m_l[i])
                        target_pmfs[i].index_add_(0, u[i].long(), d_m_u[i])

                _, old_pmfs = q_network.get_action(data.observations, data.actions.flatten().long())
                loss = (-(target_pmfs * old_pmfs.clamp(min=1e-5, max=1-1e-5).log()).sum(-1)).mean()

                # optimize the midel
                optimizer.zero_grad()
                backward(loss)
                nn.utils.clip_grad_norm_(list(q_network.parameters()), max_grad_norm)
                optimizer.step()

                # update the target network
                if global_step % target_network_frequency == 0:
                    target_network.load_state_dict(q_network.state_dict())
    return q_network, target_network


@pytest.mark.parametrize("check", checks())
def test_cleanrl_c51_projection_under_no_grad_and_target_copied_by_load_state_dict(check):
    """vwxyzjn/cleanrl, cleanrl/c51.py: epsilon-greedy actions from a forward with a graph (``pmf`` kept until
    the next greedy action), the categorical projection of the target network's distribution written in place
    by ``index_add_`` into rows of ``target_pmfs`` under ``no_grad``, ``clip_grad_norm_``, and every
    ``target_network_frequency`` steps ``target_network.load_state_dict(q_network.state_dict())``."""
    q_network, target_network = three_runs(c51_build, c51_train, check)
    assert not torch.equal(q_network.network[0].weight, target_network.network[0].weight)


# -- pytorch/examples: dcgan/main.py, its discriminator under torch.nn.utils.parametrizations.spectral_norm ------
NZ, NGF, NDF = 4, 4, 4


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, 1, 4, 2, 1, bias=False),
            nn.Tanh()
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()
        sn = torch.nn.utils.parametrizations.spectral_norm
        self.main = nn.Sequential(
            sn(nn.Conv2d(1, NDF, 4, 2, 1, bias=False)),
            nn.LeakyReLU(0.2, inplace=True),
            sn(nn.Conv2d(NDF, 1, 4, 1, 0, bias=False)),
            nn.Sigmoid()
        )

    def forward(self, input):
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


def dcgan_build():
    netG, netD = Generator(), Discriminator()
    netG.apply(weights_init)
    netD.apply(weights_init)
    gen = torch.Generator().manual_seed(8)
    dataloader = [(torch.rand(3, 1, 8, 8, generator=gen) * 2 - 1, None) for _ in range(4)]
    return netD, netG, dataloader


def dcgan_train(netD, netG, dataloader, niter=1, guard=None):
    step, backward = hooks(guard)
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(3, NZ, 1, 1)
    real_label = 1
    fake_label = 0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    for epoch in range(niter):
        for i, data in enumerate(dataloader, 0):
            with step():
                ############################
                # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
                ###########################
                # train with real
                netD.zero_grad()
                real_cpu = data[0]
                batch_size = real_cpu.size(0)
                label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)

                output = netD(real_cpu)
                errD_real = criterion(output, label)
                backward(errD_real)
                D_x = output.mean().item()

                # train with fake
                noise = torch.randn(batch_size, NZ, 1, 1)
                fake = netG(noise)
                label.fill_(fake_label)
                output = netD(fake.detach())
                errD_fake = criterion(output, label)
                backward(errD_fake)
                D_G_z1 = output.mean().item()
                errD = errD_real + errD_fake
                optimizerD.step()

                ############################
                # (2) Update G network: maximize log(D(G(z)))
                ###########################
                netG.zero_grad()
                label.fill_(real_label)  # fake labels are real for generator cost
                output = netD(fake)
                errG = criterion(output, label)
                backward(errG)
                D_G_z2 = output.mean().item()
                optimizerG.step()
                del D_x, D_G_z1, D_G_z2, errD
        with torch.no_grad():
            fake = netG(fixed_noise)
    return netD, netG


@pytest.mark.parametrize("check", checks())
def test_dcgan_with_a_spectrally_normalized_discriminator(check):
    """pytorch/examples, dcgan/main.py (the loop: D's real and fake losses back-propagated one after the other
    into one update, ``fake.detach()`` for D, ``label.fill_`` reusing one tensor as the target of all three
    losses, G's loss through D), its discriminator's convolutions under
    ``torch.nn.utils.parametrizations.spectral_norm`` (the replacement of the deprecated hook): every forward in
    training mode runs a power iteration writing ``_u``/``_v`` in place, three forwards of D per step."""
    netD, netG = three_runs(dcgan_build, dcgan_train, check)
    torch.manual_seed(0)
    start, _, _ = dcgan_build()
    assert not torch.equal(netD.main[0].parametrizations.weight[0]._u, start.main[0].parametrizations.weight[0]._u)


# -- fastai/fastai1: fastai/callback.py (SmoothenValue, CallbackHandler.on_backward_begin), basic_train.py ------
class SmoothenValue():
    "Create a smooth moving average for a value (loss, etc) using `beta`."
    def __init__(self, beta: float):
        self.beta, self.n, self.mov_avg = beta, 0, 0

    def add_value(self, val: float) -> None:
        "Add `val` to calculate updated smoothed value."
        self.n += 1
        self.mov_avg = self.beta * self.mov_avg + (1 - self.beta) * val
        self.smooth = self.mov_avg / (1 - self.beta ** self.n)


def smooth_build():
    gen = torch.Generator().manual_seed(9)
    data = [(torch.randn(4, 3, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(6)]
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), data


def smooth_fit(model, train_dl, detach=True, guard=None):
    step, backward = hooks(guard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    smoothener = SmoothenValue(0.98)
    smooth_losses = []
    for xb, yb in train_dl:
        with step():
            out = model(xb)
            loss = F.mse_loss(out, yb)
            smoothener.add_value(loss.float().detach().cpu() if detach else loss)  # on_backward_begin
            backward(loss)
            opt.step()
            opt.zero_grad()
            smooth_losses.append(smoothener.smooth.item())
    return model, smooth_losses


@pytest.mark.parametrize("check", checks())
def test_fastai_smoothed_loss_kept_as_a_detached_tensor(check):
    """fastai/fastai1, fastai/callback.py: ``CallbackHandler.on_backward_begin`` feeds
    ``loss.float().detach().cpu()`` to ``SmoothenValue``, whose ``mov_avg`` and ``smooth`` stay tensors across
    the whole fit (a debiased exponential moving average)."""
    three_runs(smooth_build, smooth_fit, check)


def test_fastai_smoothed_loss_kept_with_its_graph_is_named():
    """``smoothener.add_value(loss)``: the moving average is a chain through every step's graph, kept by an
    attribute of an object of the loop; the guard names ``smoothener.mov_avg``, under ``watch`` and in
    ``GraphGuard``, as it names a running mean kept in a local variable (yolov5's ``mloss``)."""
    for guard in (None, GraphGuard(check="always")):
        torch.manual_seed(0)
        model, data = smooth_build()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if guard is None:
                watched(smooth_fit, model, data, False)
            else:
                smooth_fit(model, data, False, guard=guard)
        leaks = [str(w.message) for w in caught if issubclass(w.category, GraphLeakWarning)]
        assert leaks, "the leak went unseen"
        assert any(re.search(r"held by `smoothener\.(mov_avg|smooth)`", text) for text in leaks), leaks


# -- facebookresearch/moco: moco/builder.py (MoCo) and main_moco.py (train) ----------------------------------------
class MoCo(nn.Module):
    """MoCo with ``queue_clone``: ``self.queue.clone().detach()`` as the source has it, or ``self.queue.detach()``
    (the mistake: the queue the negative logits saved is then overwritten by ``_dequeue_and_enqueue`` before
    the backward). One process: no all-gather, no batch shuffle."""

    def __init__(self, base_encoder, dim=4, K=8, m=0.999, T=0.07, queue_clone=True):
        super(MoCo, self).__init__()
        self.K = K
        self.m = m
        self.T = T
        self.queue_clone = queue_clone
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)  # initialize
            param_k.requires_grad = False  # not update by gradient
        # create the queue
        self.register_buffer("queue", torch.randn(dim, K))
        self.queue = nn.functional.normalize(self.queue, dim=0)
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1. - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0  # for simplicity
        # replace the keys at ptr (dequeue and enqueue)
        self.queue[:, ptr:ptr + batch_size] = keys.T
        ptr = (ptr + batch_size) % self.K  # move pointer
        self.queue_ptr[0] = ptr

    def forward(self, im_q, im_k):
        q = self.encoder_q(im_q)  # queries: NxC
        q = nn.functional.normalize(q, dim=1)
        with torch.no_grad():  # no gradient to keys
            self._momentum_update_key_encoder()  # update the key encoder
            k = self.encoder_k(im_k)  # keys: NxC
            k = nn.functional.normalize(k, dim=1)
        l_pos = torch.einsum('nc,nc->n', [q, k]).unsqueeze(-1)
        queue = self.queue.clone().detach() if self.queue_clone else self.queue.detach()
        l_neg = torch.einsum('nc,ck->nk', [q, queue])
        logits = torch.cat([l_pos, l_neg], dim=1)
        logits /= self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        self._dequeue_and_enqueue(k)
        return logits, labels


def encoder(num_classes):
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, num_classes))


def moco_build(queue_clone=True):
    gen = torch.Generator().manual_seed(10)
    loader = [([torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)], None) for _ in range(5)]
    return MoCo(encoder, queue_clone=queue_clone), loader


def moco_train(model, train_loader, guard=None):
    step, backward = hooks(guard)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.03, momentum=0.9, weight_decay=1e-4)
    model.train()
    for i, (images, _) in enumerate(train_loader):
        with step():
            # compute output
            output, target = model(im_q=images[0], im_k=images[1])
            loss = criterion(output, target)
            # compute gradient and do SGD step
            optimizer.zero_grad()
            backward(loss)
            optimizer.step()
    return model, model.queue.clone(), int(model.queue_ptr)


@pytest.mark.parametrize("check", checks())
def test_moco_queue_cloned_before_the_enqueue(check):
    """facebookresearch/moco, moco/builder.py: the negative logits on ``self.queue.clone().detach()``, the queue
    then overwritten in place by ``_dequeue_and_enqueue`` inside the forward, before the backward; the key
    encoder's momentum update rebinding ``param_k.data`` (parameters that do not require grad)."""
    three_runs(moco_build, moco_train, check)


def test_moco_queue_not_cloned_is_named():
    """Without ``.clone()``: the einsum saved the queue, which the enqueue then overwrites before the backward.
    PyTorch raises its in-place error inside the backward; the guard explains it before any ``.grad`` is written,
    naming ``model.queue``."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        moco_train(*moco_build(queue_clone=False))
    for guard in (None, GraphGuard()):
        torch.manual_seed(0)
        model, loader = moco_build(queue_clone=False)
        start = deepcopy(model)
        with pytest.raises(InplaceModificationError, match=r"`(local )?model\.queue`"):
            if guard is None:
                watched(moco_train, model, loader, check="auto")
            else:
                moco_train(model, loader, guard=guard)
        assert all(p.grad is None for p in model.parameters())  # (the forward moved batch-norm statistics, encoder_k)
        assert all(torch.equal(p, q) for p, q in zip(model.encoder_q.parameters(), start.encoder_q.parameters()))


# -- pytorch/vision: references/classification/train.py (train_one_epoch) and utils.py
#    (ExponentialMovingAverage, accuracy), under CPU bfloat16 autocast with torch.amp.GradScaler("cpu") ----------
class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """Maintains moving averages of model parameters using an exponential decay.
    ``ema_avg = decay * avg_model_param + (1 - decay) * model_param``"""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.inference_mode():
        maxk = max(topk)
        batch_size = target.size(0)
        if target.ndim == 2:
            target = target.max(dim=1)[1]

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target[None])

        res = []
        for k in topk:
            correct_k = correct[:k].flatten().sum(dtype=torch.float32)
            res.append(correct_k * (100.0 / batch_size))
        return res


def tv_build():
    gen = torch.Generator().manual_seed(11)
    data_loader = [(torch.randn(8, 4, generator=gen), torch.randint(3, (8,), generator=gen)) for _ in range(3)]
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    return model, data_loader


def tv_train(model, data_loader, epochs=2, model_ema_steps=2, lr_warmup_epochs=1, clip_grad_norm=1.0,
             guard=None):
    step, backward = hooks(guard)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    model_ema = ExponentialMovingAverage(model, decay=1.0 - 0.1)
    meters = []
    for epoch in range(epochs):
        model.train()
        for i, (image, target) in enumerate(data_loader):
            with step():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
                    output = model(image)
                    loss = criterion(output, target)

                optimizer.zero_grad()
                if scaler is not None:
                    backward(scaler.scale(loss))
                    if clip_grad_norm is not None:
                        # we should unscale the gradients of optimizer's assigned params if do gradient clipping
                        scaler.unscale_(optimizer)
                        nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
                    scaler.step(optimizer)
                    scaler.update()

                if model_ema and i % model_ema_steps == 0:
                    model_ema.update_parameters(model)
                    if epoch < lr_warmup_epochs:
                        # Reset ema buffer to keep copying weights during warmup period
                        model_ema.n_averaged.fill_(0)

                acc1, acc2 = accuracy(output, target, topk=(1, 2))
                meters.append((loss.item(), optimizer.param_groups[0]["lr"], acc1.item(), acc2.item()))
    return model, model_ema, meters, scaler.get_scale()


@pytest.mark.parametrize("check", checks())
def test_torchvision_train_one_epoch_under_bf16_autocast_with_a_scaler_and_ema(check):
    """pytorch/vision, references/classification/train.py (``train_one_epoch``: autocast around the forward and
    loss, ``scaler.scale(loss).backward()``, ``scaler.unscale_`` before ``clip_grad_norm_``, an EMA every
    ``model_ema_steps`` with ``n_averaged.fill_(0)`` during the warm-up, the accuracy of the step's ``output``
    after the update) and utils.py (``ExponentialMovingAverage`` over parameters and buffers, ``accuracy`` under
    ``inference_mode``), with ``torch.autocast("cpu", dtype=torch.bfloat16)`` and ``GradScaler("cpu")``."""
    model, model_ema, meters, scale = three_runs(tv_build, tv_train, check)
    assert int(model_ema.n_averaged) == 2  # two updates after the warm-up epoch
    assert not torch.equal(model_ema.module[0].weight, model[0].weight)
