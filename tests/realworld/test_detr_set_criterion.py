"""DETR's weighted loss dict: facebookresearch/detr, models/detr.py (``SetCriterion.forward`` with
``loss_labels``, ``loss_boxes``' L1 term and the auxiliary decoder-layer losses ``loss_ce_0``, ...,
``build``'s ``weight_dict``) and engine.py (``train_one_epoch``: ``losses = sum(loss_dict[k] * weight_dict[k]
for k in loss_dict.keys() if k in weight_dict)``, one backward, ``clip_grad_norm_(max_norm)``, step).

``class_error`` is in the loss dict but not in ``weight_dict``: engine.py only logs it.

Changes for a seconds-long test: a linear "decoder" of 2 layers over 4 queries of 8 features, 3 classes plus
no-object; the Hungarian matcher replaced by the identity matching (query i to target i), the GIoU term left
out; AdamW, max_norm 0.1 as main.py.

Ports: (a) the sum as engine.py writes it, returned as one loss; (b) the weighted keys returned as a dict
with ``loss_weights=weight_dict`` and ``multi_loss="sum"``; (c) the same in the default ``"sequential"``.
"""
import pytest
import torch
import torch.nn.functional as F

from safeloop import NoGraphError, Trainer

from .harness import checks, compare, fixed

Q, D, C, LAYERS, STEPS = 4, 8, 3, 2, 3
weight_dict = {'loss_ce': 1, 'loss_bbox': 5}
aux_weight_dict = {}
for i in range(LAYERS - 1):
    aux_weight_dict.update({k + f'_{i}': v for k, v in weight_dict.items()})
weight_dict.update(aux_weight_dict)
EOS_COEF = 0.1


class Detr(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(LAYERS))
        self.class_embed = torch.nn.Linear(D, C + 1)
        self.bbox_embed = torch.nn.Linear(D, 4)
        empty_weight = torch.ones(C + 1)
        empty_weight[-1] = EOS_COEF
        self.register_buffer('empty_weight', empty_weight)

    def forward(self, x):
        hs = []
        for layer in self.layers:
            x = torch.relu(layer(x))
            hs.append(x)
        outputs_class = [self.class_embed(h) for h in hs]
        outputs_coord = [self.bbox_embed(h).sigmoid() for h in hs]
        out = {'pred_logits': outputs_class[-1], 'pred_boxes': outputs_coord[-1]}
        out['aux_outputs'] = [{'pred_logits': a, 'pred_boxes': b}
                              for a, b in zip(outputs_class[:-1], outputs_coord[:-1])]
        return out


def single(model, outputs, labels, boxes, log=True):
    src_logits = outputs['pred_logits']
    loss_ce = F.cross_entropy(src_logits.transpose(1, 2), labels, model.empty_weight)
    losses = {'loss_ce': loss_ce}
    if log:
        matched = labels != C
        acc = (src_logits[matched].argmax(-1) == labels[matched]).float().mean() * 100
        losses['class_error'] = 100 - acc
    matched = labels != C
    loss_bbox = F.l1_loss(outputs['pred_boxes'][matched], boxes[matched], reduction='none')
    losses['loss_bbox'] = loss_bbox.sum() / max(int(matched.sum()), 1)
    return losses


def criterion(model, outputs, labels, boxes):
    losses = single(model, outputs, labels, boxes)
    for i, aux in enumerate(outputs['aux_outputs']):
        l_dict = single(model, aux, labels, boxes, log=False)
        losses.update({k + f'_{i}': v for k, v in l_dict.items()})
    return losses


def data_items():
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x = torch.randn(2, Q, D, generator=gen)
        labels = torch.randint(C + 1, (2, Q), generator=gen)
        labels[:, 0] = 0
        out.append((x, labels, torch.rand(2, Q, 4, generator=gen)))
    return out


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)


def hand(model, data):
    opt = optimizer(model)
    for x, labels, boxes in data:
        loss_dict = criterion(model, model(x), labels, boxes)
        losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in weight_dict)
        opt.zero_grad()
        losses.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()


class SumPort(Trainer):
    def configure_optimizers(self):
        return optimizer(self.model)

    def training_step(self, batch):
        x, labels, boxes = batch
        loss_dict = criterion(self.model, self.model(x), labels, boxes)
        self.log('class_error', loss_dict['class_error'])
        return sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in weight_dict)


class DictPort(SumPort):
    def training_step(self, batch):
        x, labels, boxes = batch
        loss_dict = criterion(self.model, self.model(x), labels, boxes)
        self.log('class_error', loss_dict.pop('class_error'))
        return loss_dict


@pytest.mark.parametrize("check", checks())
def test_detr_summed_by_hand(check):
    compare(Detr, hand, SumPort, fixed(data_items()), check, STEPS, grad_clip=0.1)


@pytest.mark.parametrize("check", checks())
def test_detr_dict_sum(check):
    compare(Detr, hand, DictPort, fixed(data_items()), check, STEPS, grad_clip=0.1,
            loss_weights=weight_dict, multi_loss="sum")


class FullDictPort(SumPort):
    """The whole loss dict returned, ``class_error`` (a no-gradient metric, not in ``weight_dict``) included."""
    def training_step(self, batch):
        x, labels, boxes = batch
        return criterion(self.model, self.model(x), labels, boxes)


@pytest.mark.parametrize("check", checks())
def test_detr_full_dict_sum(check):
    # Under "sum" the metric is added to the weighted sum (weight 1): no gradient, the same weights.
    compare(Detr, hand, FullDictPort, fixed(data_items()), check, STEPS, grad_clip=0.1,
            loss_weights=weight_dict, multi_loss="sum")


def test_detr_full_dict_sequential_says_to_log_the_metric_it_holds():
    """Sequential backwards of the whole dict: its ``class_error`` (a metric with no graph) cannot be
    back-propagated, and the error says to log it instead (under ``sum`` a constant term changes no gradient)."""
    with pytest.raises(NoGraphError, match=r"\(step 1, loss 'class_error'\).*To fix: if 'class_error' is a metric, "
                                           r"log it with self.log\('class_error', value\) rather than return it"):
        compare(Detr, hand, FullDictPort, fixed(data_items()), "auto", STEPS, grad_clip=0.1,
                loss_weights=weight_dict)
