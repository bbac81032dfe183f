"""A detector's loss dict (facebookresearch/detr's ``SetCriterion`` output, torchvision's detection models') kept
whole for logging, step after step, as TRI-ML/packnet-sfm's trainer did before its fix (issue #47: ``outputs``
holding each step's ``output['loss']`` for the epoch)."""
import re
from collections import defaultdict
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import GraphGuard, GraphLeakWarning


def detector_loop(check: str | None, detach: bool = False):
    """Four steps of a two-head "detector" whose losses come as a dict, summed for the backward; each step's dict is
    appended to ``history`` (``detach``: its values detached there). Returns the weights and the logged sums."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3 + 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check=check) if check else None
    history = []
    for _ in range(4):
        x, labels, boxes = torch.randn(5, 4), torch.randint(0, 3, (5,)), torch.rand(5, 4)
        out = model(x)
        loss_dict = {'loss_ce': F.cross_entropy(out[:, :3], labels), 'loss_bbox': F.l1_loss(out[:, 3:], boxes)}
        losses = sum(loss_dict.values())
        opt.zero_grad()
        guard.backward(losses) if guard else losses.backward()
        opt.step()
        history.append({k: v.detach() for k, v in loss_dict.items()} if detach else loss_dict)
    return [p.detach().clone() for p in model.parameters()], [sum(d.values()).item() for d in history]


def test_a_list_of_loss_dicts_is_named_with_the_fix_at_the_append_and_the_fix_works():
    with pytest.warns(GraphLeakWarning, match=re.escape("one more dict in `history` every step")) as caught:
        detector_loop("always")
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert leak.fixes and "`history.append({k: v.detach() for k, v in d.items()})`" in leak.fixes[0], leak.fixes
    bare = detector_loop(None, detach=True)
    for check in ("always", "auto", "off"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fixed = detector_loop(check, detach=True)
        assert fixed[1] == bare[1] and all(torch.equal(a, b) for a, b in zip(fixed[0], bare[0]))


class Meter:
    """torchvision's ``SmoothedValue`` (references/detection/utils.py), reduced: a running total."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def update(self, value):
        self.total += value
        self.count += 1


class MetricLogger:
    """torchvision's ``MetricLogger`` without the ``v.item()`` of its ``update``: it keeps what it is handed."""

    def __init__(self):
        self.meters = defaultdict(Meter)

    def update(self, **kwargs):
        for k, v in kwargs.items():
            self.meters[k].update(v)


def train_one_epoch(model, opt, guard, data):
    metric_logger = MetricLogger()
    for x, y in data:
        loss_dict = {'loss_a': F.mse_loss(model(x), y), 'loss_b': model(x).abs().mean()}
        losses = sum(loss_dict.values())
        opt.zero_grad()
        guard.backward(losses)
        opt.step()
        metric_logger.update(loss=losses, **loss_dict)
    return metric_logger


def test_a_metric_logger_keeping_the_losses_in_a_defaultdict_is_named_once():
    """The meters are a ``defaultdict`` of objects: the holder is found inside them, and the same pile, found again
    under the name that holds the logger an epoch returned, is not warned twice."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check="always")
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    with pytest.warns(GraphLeakWarning) as caught:
        for _ in range(2):
            logger = train_one_epoch(model, opt, guard, data)
    leaks = [w.message for w in caught if w.category is GraphLeakWarning]
    assert [leak.holder for leak in leaks] == ["metric_logger.meters['loss'].total"], leaks
    assert logger.meters['loss'].count == 4
