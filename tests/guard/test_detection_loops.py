"""Object-detection loops under the guard: ultralytics/yolov5's train.py (a warm-up of lr and momentum written by
hand into the param groups, ``accumulate``, ``GradScaler``, ``ModelEMA`` from utils/torch_utils.py, the running mean
``mloss`` of the loss items ``ComputeLoss`` detaches) and the mistakes people make around it: the EMA updated
outside ``torch.no_grad()`` (harmless the way ultralytics writes it, from the detached ``state_dict()``; a graph
chained step after step the way many ports write it, from ``parameters()``), the warm-up written into the param
groups as tensors, anchors computed once before the loop from the model, and a loss dict made before the loop whose
entry is only written on some iterations. Each loop runs bare, with ``GraphGuard`` written in (``check`` "always",
"auto" and "off") and under ``Watch`` (``python -m safeloop.watch``'s guard, in process)."""
import contextlib
import math
import re
import warnings
from copy import deepcopy

import numpy as np
import pytest
import torch
from torch import nn

from safeloop import CarriedGraphError, GraphGuard, GraphLeakWarning, GraphReuseError
from safeloop.watch import Watch

HYP = {'lr0': 0.01, 'lrf': 0.01, 'momentum': 0.937, 'weight_decay': 0.0005, 'warmup_momentum': 0.8,
       'warmup_bias_lr': 0.1, 'box': 0.05, 'cls': 0.5, 'obj': 1.0}
NC = 3


class ModelEMA:
    """utils/torch_utils.py's ModelEMA. ``how``: "state_dict" (yolov5's ``update``: ``state_dict()`` tensors, which
    carry no graph, and ``msd[k].detach()``) or "parameters" (the EMA of the parameters alone, by
    ``zip(ema.parameters(), model.parameters())``, as many ports write it); ``no_grad``: under ``torch.no_grad()``
    (yolov5's v6; ultralytics' later ``update`` has none)."""

    def __init__(self, model, how="state_dict", no_grad=True, decay=0.9999):
        self.ema = deepcopy(model).eval()
        self.updates, self.how, self.no_grad = 0, how, no_grad
        self.decay = lambda x: decay * (1 - math.exp(-x / 2000))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        with torch.no_grad() if self.no_grad else contextlib.nullcontext():
            self.updates += 1
            d = self.decay(self.updates)
            if self.how == "parameters":
                for e, p in zip(self.ema.parameters(), model.parameters()):
                    e.mul_(d).add_((1 - d) * p)
                return
            msd = model.state_dict()
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= d
                    v += (1 - d) * msd[k].detach()


class Detector(nn.Module):
    """A few convolutions over 16x16 images: per cell 4 box offsets, 1 objectness, NC class logits; ``prior``
    gives per-cell anchor sizes learned from a constant input."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU(),
                                  nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.head = nn.Conv2d(8, 5 + NC, 1)
        self.prior = nn.Conv2d(1, 4, 1)

    def forward(self, x):
        return self.head(self.body(x))


def compute_loss(p, targets, anchors):
    """utils/loss.py's ComputeLoss, reduced: three (1,)-shaped sums, scaled by the batch size, items detached."""
    lcls, lbox, lobj = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    tbox, tobj, tcls = targets
    lbox += (p[:, :4] - (tbox - anchors)).pow(2).mean()
    lobj += nn.functional.binary_cross_entropy_with_logits(p[:, 4], tobj)
    lcls += nn.functional.binary_cross_entropy_with_logits(p[:, 5:], tcls)
    lbox *= HYP['box']
    lobj *= HYP['obj']
    lcls *= HYP['cls']
    bs = tobj.shape[0]
    return (lbox + lobj + lcls) * bs, torch.cat((lbox, lobj, lcls)).detach()


def batches(n=3):
    """``n`` batches of two 16x16 images, each with three boxes drawn onto the 4x4 grid of cells."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        tbox, tobj, tcls = torch.zeros(2, 4, 4, 4), torch.zeros(2, 4, 4), torch.zeros(2, NC, 4, 4)
        for b in range(2):
            for _ in range(3):
                i, j, c = (int(v) for v in torch.randint(0, 4, (3,), generator=gen))
                tbox[b, :, i, j], tobj[b, i, j], tcls[b, c % NC, i, j] = torch.rand(4, generator=gen), 1.0, 1.0
        out.append((torch.rand(2, 3, 16, 16, generator=gen), (tbox, tobj, tcls)))
    return out


def yolo_train(guard=None, ema_how="state_dict", ema_no_grad=True, tensor_lr=False, anchors_before=False, fixed=False,
               epochs=2, batch_size=2, nbs=8):
    """yolov5's train.py loop (v6): smart_optimizer's three param groups (BatchNorm weights without decay),
    warm-up by hand, ``accumulate``, ``scaler.step``, ``ema.update`` after each optimizer step, ``mloss``,
    ``scheduler.step()`` per epoch. ``anchors_before``: anchors computed from the model before the loop (``fixed``:
    under ``torch.no_grad()``); otherwise from a constant. Returns the model, the EMA model and ``mloss``."""
    torch.manual_seed(0)
    model, train_loader = Detector(), batches()
    step, backward = (guard.step, guard.backward) if guard else (contextlib.nullcontext, torch.Tensor.backward)
    g = [], [], []  # optimizer parameter groups
    bn = tuple(v for k, v in nn.__dict__.items() if 'Norm' in k)  # normalization layers, i.e. BatchNorm2d()
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=False):
            if p_name == 'bias':  # bias (no decay)
                g[2].append(p)
            elif p_name == 'weight' and isinstance(v, bn):  # weight (no decay)
                g[1].append(p)
            else:
                g[0].append(p)  # weight (with decay)
    optimizer = torch.optim.SGD(g[2], lr=HYP['lr0'], momentum=HYP['momentum'], nesterov=True)
    optimizer.add_param_group({'params': g[0], 'weight_decay': HYP['weight_decay']})  # add g0 with weight_decay
    optimizer.add_param_group({'params': g[1], 'weight_decay': 0.0})  # add g1 (BatchNorm2d weights)
    lf = lambda x: (1 - x / epochs) * (1.0 - HYP['lrf']) + HYP['lrf']  # noqa: E731 (linear)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model, ema_how, ema_no_grad)
    if anchors_before:
        with torch.no_grad() if fixed else contextlib.nullcontext():
            anchors = model.prior(torch.ones(1, 1, 4, 4)).sigmoid()
    else:
        anchors = torch.full((1, 4, 4, 4), 0.5)
    nb = len(train_loader)  # number of batches
    nw = max(round(nb), 3)  # number of warmup iterations
    last_opt_step = -1
    scheduler.last_epoch = -1  # do not move
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for epoch in range(epochs):
        model.train()
        mloss = torch.zeros(3)  # mean losses
        optimizer.zero_grad()
        for i, (imgs, targets) in enumerate(train_loader):
            with step():
                ni = i + nb * epoch  # number integrated batches (since train start)
                if ni <= nw:  # Warmup
                    xi = [0, nw]  # x interp
                    accumulate = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
                    for j, x in enumerate(optimizer.param_groups):
                        # bias lr falls from 0.1 to lr0, all other lrs rise from 0.0 to lr0
                        x['lr'] = np.interp(ni, xi, [HYP['warmup_bias_lr'] if j == 0 else 0.0,
                                                     x['initial_lr'] * lf(epoch)])
                        if 'momentum' in x:
                            x['momentum'] = np.interp(ni, xi, [HYP['warmup_momentum'], HYP['momentum']])
                        if tensor_lr:
                            x['lr'], x['momentum'] = torch.tensor(x['lr']), torch.tensor(x['momentum'])
                with torch.autocast("cpu", enabled=False):
                    pred = model(imgs)  # forward
                    loss, loss_items = compute_loss(pred, targets, anchors)  # loss scaled by batch_size
                backward(scaler.scale(loss))
                if ni - last_opt_step >= accumulate:  # Optimize
                    scaler.unscale_(optimizer)  # unscale gradients
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)  # clip gradients
                    scaler.step(optimizer)  # optimizer.step
                    scaler.update()
                    optimizer.zero_grad()
                    if ema:
                        ema.update(model)
                    last_opt_step = ni
                mloss = (mloss * i + loss_items) / (i + 1)  # update mean losses
        scheduler.step()
    return model, ema.ema, mloss


def same(ours, ref):
    """What two runs returned (modules, with their buffers, and tensors) is equal, bit for bit."""
    for a, b in zip(ours, ref, strict=True):
        pairs = [(a, b)] if isinstance(a, torch.Tensor) else zip(a.state_dict().values(), b.state_dict().values())
        assert all(torch.equal(x, y) for x, y in pairs)


def quiet_and_same(loop, check, **kwargs):
    """``loop(**kwargs)`` bare, with a GraphGuard and under Watch: no warning, no error, bit for bit the same."""
    ref = loop(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same(loop(guard=GraphGuard(check=check), **kwargs), ref)
        with Watch(GraphGuard(check=check), loop.__code__.co_filename):
            same(loop(**kwargs), ref)
    return ref


CHECKS = ("always", "auto", "off")


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("how, no_grad", [("state_dict", True), ("state_dict", False), ("parameters", True)])
def test_yolov5_with_its_ema_is_quiet(check, how, no_grad):
    """yolov5's ``ModelEMA.update`` under ``torch.no_grad()``; ultralytics' later one without it (the ``state_dict()``
    tensors it reads and writes carry no graph); an EMA of the parameters alone, under ``torch.no_grad()`` (the fix
    the guard gives below): quiet, bit for bit."""
    model, ema, mloss = quiet_and_same(yolo_train, check, ema_how=how, ema_no_grad=no_grad)
    assert mloss.grad_fn is None and all(p.grad_fn is None for p in ema.parameters())


@pytest.mark.parametrize("check", ["always", "auto"])
@pytest.mark.parametrize("watched", [False, True])
def test_an_ema_of_the_parameters_kept_by_a_plain_object_written_outside_no_grad_is_named(check, watched):
    """The EMA of the parameters written in place outside ``torch.no_grad()``: every write extends the EMA
    parameters' graph. ``ema`` is a plain object, its model ``ema.ema``: the guard names those parameters, and
    gives the fix, the write under ``torch.no_grad()`` (quiet, bit for bit: the test above)."""
    fix = re.escape("To fix: make that write under `torch.no_grad()`")
    with pytest.warns(GraphLeakWarning, match=re.escape("the parameters `ema.ema.body.0.weight`") + ".*" + fix):
        if watched:
            with Watch(GraphGuard(check=check), yolo_train.__code__.co_filename):
                yolo_train(ema_how="parameters", ema_no_grad=False)
        else:
            yolo_train(guard=GraphGuard(check=check), ema_how="parameters", ema_no_grad=False)


@pytest.mark.parametrize("check", CHECKS)
def test_a_warm_up_written_into_the_param_groups_as_tensors_is_quiet(check):
    """``x['lr']`` and ``x['momentum']`` written as tensors by the warm-up: no graph, nothing to say."""
    quiet_and_same(yolo_train, check, tensor_lr=True)


@pytest.mark.parametrize("check", CHECKS)
def test_anchors_computed_before_the_loop_under_no_grad_are_quiet(check):
    quiet_and_same(yolo_train, check, anchors_before=True, fixed=True)


@pytest.mark.parametrize("check", CHECKS)
def test_anchors_computed_from_the_model_before_the_loop_are_named(check):
    """Anchors made once before the loop from the model (``model.prior``), with their graph: the second step would
    back-propagate through it again. The guard names ``anchors`` and says to make it under ``torch.no_grad()``; so
    made, the loop trains quiet, bit for bit (the test above)."""
    named = r"held by `local anchors`.*store `anchors.detach\(\)` instead, or compute it under `torch.no_grad\(\)`"
    with pytest.raises(GraphReuseError, match=named):
        yolo_train(guard=GraphGuard(check=check), anchors_before=True)
    with pytest.raises(GraphReuseError, match=named), Watch(GraphGuard(check=check), yolo_train.__code__.co_filename):
        yolo_train(anchors_before=True)


# -- pytorch/vision, references/detection/engine.py (train_one_epoch) --------------------------------------------
class MaskDetector(nn.Module):
    """A detector in train mode returning its loss dict, as torchvision's do; ``loss_mask`` only for the batches
    whose targets have masks (a model of one's own with an optional head)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4, padding=1), nn.ReLU())
        self.box = nn.Linear(8, 4 * 3)
        self.cls = nn.Linear(8, 3 * (NC + 1))
        self.mask = nn.Conv2d(8, 3, 1)

    def forward(self, images, targets):
        features = self.body(torch.stack(images))
        pooled = features.mean((2, 3))
        boxes, labels = torch.stack([t["boxes"] for t in targets]), torch.stack([t["labels"] for t in targets])
        losses = {"loss_classifier": nn.functional.cross_entropy(self.cls(pooled).view(-1, NC + 1), labels.flatten()),
                  "loss_box_reg": nn.functional.smooth_l1_loss(self.box(pooled).view(-1, 3, 4), boxes, beta=1 / 9)}
        if "masks" in targets[0]:
            masks = torch.stack([t["masks"] for t in targets])
            losses["loss_mask"] = nn.functional.binary_cross_entropy_with_logits(self.mask(features), masks)
        return losses


def detection_batches():
    gen = torch.Generator().manual_seed(5)
    loader = []
    for i in range(4):
        targets = [{"boxes": torch.rand(3, 4, generator=gen), "labels": torch.randint(1, NC + 1, (3,), generator=gen)}
                   for _ in range(2)]
        if i % 2 == 0:
            for t in targets:
                t["masks"] = torch.rand(3, 4, 4, generator=gen).round()
        loader.append(([torch.rand(3, 16, 16, generator=gen) for _ in range(2)], targets))
    return loader


def train_one_epoch(guard=None, dict_before=False, cleared=False, mean_of=None):
    """engine.py's ``train_one_epoch`` on one process (``reduce_dict`` returns the dict), its warm-up a LambdaLR
    stepped every iteration. ``dict_before``: the loss dict made before the loop and updated from the model's
    (``cleared``: made anew, ``loss_dict = {}``, at the start of each step). ``mean_of``: a running mean of each loss
    kept for logging, of ``loss_dict_reduced`` (its graphs kept) or of its values ``.item()``-ed."""
    torch.manual_seed(0)
    model, data_loader = MaskDetector(), detection_batches()
    step, backward = (guard.step, guard.backward) if guard else (contextlib.nullcontext, torch.Tensor.backward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    warmup_factor, warmup_iters = 1.0 / 1000, min(1000, len(data_loader) - 1)

    def f(x):
        if x >= warmup_iters:
            return 1
        alpha = float(x) / warmup_iters
        return warmup_factor * (1 - alpha) + alpha
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, f)
    logged, loss_dict, mean = [], {}, {}
    for i, (images, targets) in enumerate(data_loader):
        with step():
            if cleared:
                loss_dict = {}
            if dict_before:
                loss_dict.update(model(images, targets))
            else:
                loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())
            with torch.no_grad():  # reduce_dict: reduce losses over all GPUs for logging purposes
                loss_dict_reduced = loss_dict
            losses_reduced = sum(loss for loss in loss_dict_reduced.values())
            loss_value = losses_reduced.item()
            if not math.isfinite(loss_value):
                raise SystemExit(1)
            optimizer.zero_grad()
            backward(losses)
            optimizer.step()
            lr_scheduler.step()
            logged.append(loss_value)
            if mean_of == "dict":
                mean = {k: (mean.get(k, 0) * i + v) / (i + 1) for k, v in loss_dict_reduced.items()}
            elif mean_of == "items":
                mean = {k: (mean.get(k, 0) * i + v.item()) / (i + 1) for k, v in loss_dict_reduced.items()}
    return model, torch.tensor(logged)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("mean_of", [None, "items"])
def test_torchvision_detection_engine_is_quiet(check, mean_of):
    quiet_and_same(train_one_epoch, check, mean_of=mean_of)


@pytest.mark.parametrize("check", ["always", "auto"])
def test_a_running_mean_of_the_loss_dict_kept_with_its_graphs_is_named(check):
    """A running mean of each loss of ``loss_dict_reduced``, kept for logging without ``.item()``: each value holds
    the graphs of every step so far. The guard names ``mean`` (its fix, ``.item()``, the test above)."""
    with pytest.warns(GraphLeakWarning, match=re.escape("held by `local mean['loss_classifier']`") + ".*" +
                      re.escape("Store loss.item()")):
        train_one_epoch(guard=GraphGuard(check=check), mean_of="dict")


@pytest.mark.parametrize("check", CHECKS)
def test_a_loss_dict_made_before_the_loop_keeping_the_last_iterations_loss_is_named(check):
    """The loss dict made before the loop and updated from the model's: on a batch without masks, ``loss_mask`` is
    the last iteration's, its graph freed by that backward. The guard names ``loss_dict['loss_mask']`` and first says
    to make the dict anew every step; so made, the loop trains quiet, bit for bit as the source's."""
    named = re.escape("held by `local loss_dict['loss_mask']`") + ".*" + re.escape(
        "To fix: make `loss_dict` anew every step (`loss_dict = {}` at the start of each step")
    with pytest.raises(CarriedGraphError, match=named):
        train_one_epoch(guard=GraphGuard(check=check), dict_before=True)
    with pytest.raises(CarriedGraphError, match=named), \
            Watch(GraphGuard(check=check), train_one_epoch.__code__.co_filename):
        train_one_epoch(dict_before=True)
    same(quiet_and_same(train_one_epoch, check, dict_before=True, cleared=True), train_one_epoch())
