# detr_hungarian_aux_losses.py (DETR's train_one_epoch, matcher and SetCriterion) with each step's `loss_dict` kept
# whole for an epoch summary, `history.append(loss_dict)`: its losses keep their graphs, one more dict every step
# (TRI-ML/packnet-sfm issue #47: a trainer's `outputs` list holding each step's `output['loss']`; fixed by
# detaching the loss before appending it).
import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
Q, D, C, LAYERS, STEPS, MAX_NORM = 4, 8, 3, 3, 5, 0.1


def linear_sum_assignment(cost):
    cost = np.asarray(cost)
    rows = range(cost.shape[0])
    best = min(itertools.permutations(rows, cost.shape[1]), key=lambda p: sum(cost[i, j] for j, i in enumerate(p)))
    order = np.argsort(best)
    return np.asarray(best)[order], np.arange(cost.shape[1])[order]


def box_cxcywh_to_xyxy(x):
    x_c, y_c, w, h = x.unbind(-1)
    b = [(x_c - 0.5 * w), (y_c - 0.5 * h), (x_c + 0.5 * w), (y_c + 0.5 * h)]
    return torch.stack(b, dim=-1)


def box_area(boxes):
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def generalized_box_iou(boxes1, boxes2):
    area1, area2 = box_area(boxes1), box_area(boxes2)
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[:, :, 0] * wh[:, :, 1]
    union = area1[:, None] + area2 - inter
    iou = inter / union
    lt = torch.min(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.max(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    area = wh[:, :, 0] * wh[:, :, 1]
    return iou - (area - union) / area


@torch.no_grad()
def accuracy(output, target, topk=(1,)):
    maxk = max(topk)
    batch_size = target.size(0)
    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].view(-1).float().sum(0).mul_(100.0 / batch_size) for k in topk]


class HungarianMatcher(nn.Module):
    def __init__(self, cost_class=1, cost_bbox=5, cost_giou=2):
        super().__init__()
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def forward(self, outputs, targets):
        bs, num_queries = outputs["pred_logits"].shape[:2]
        out_prob = outputs["pred_logits"].flatten(0, 1).softmax(-1)
        out_bbox = outputs["pred_boxes"].flatten(0, 1)
        tgt_ids = torch.cat([v["labels"] for v in targets])
        tgt_bbox = torch.cat([v["boxes"] for v in targets])
        cost_class = -out_prob[:, tgt_ids]
        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox))
        C = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        C = C.view(bs, num_queries, -1).cpu()
        sizes = [len(v["boxes"]) for v in targets]
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(C.split(sizes, -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]


class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher, weight_dict, eos_coef, losses):
        super().__init__()
        self.num_classes, self.matcher, self.weight_dict, self.eos_coef, self.losses = (
            num_classes, matcher, weight_dict, eos_coef, losses)
        empty_weight = torch.ones(self.num_classes + 1)
        empty_weight[-1] = self.eos_coef
        self.register_buffer('empty_weight', empty_weight)

    def loss_labels(self, outputs, targets, indices, num_boxes, log=True):
        src_logits = outputs['pred_logits']
        idx = self._get_src_permutation_idx(indices)
        target_classes_o = torch.cat([t["labels"][J] for t, (_, J) in zip(targets, indices)])
        target_classes = torch.full(src_logits.shape[:2], self.num_classes, dtype=torch.int64)
        target_classes[idx] = target_classes_o
        loss_ce = F.cross_entropy(src_logits.transpose(1, 2), target_classes, self.empty_weight)
        losses = {'loss_ce': loss_ce}
        if log:
            losses['class_error'] = 100 - accuracy(src_logits[idx], target_classes_o)[0]
        return losses

    @torch.no_grad()
    def loss_cardinality(self, outputs, targets, indices, num_boxes):
        pred_logits = outputs['pred_logits']
        tgt_lengths = torch.as_tensor([len(v["labels"]) for v in targets])
        card_pred = (pred_logits.argmax(-1) != pred_logits.shape[-1] - 1).sum(1)
        return {'cardinality_error': F.l1_loss(card_pred.float(), tgt_lengths.float())}

    def loss_boxes(self, outputs, targets, indices, num_boxes):
        idx = self._get_src_permutation_idx(indices)
        src_boxes = outputs['pred_boxes'][idx]
        target_boxes = torch.cat([t['boxes'][i] for t, (_, i) in zip(targets, indices)], dim=0)
        loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction='none')
        losses = {'loss_bbox': loss_bbox.sum() / num_boxes}
        loss_giou = 1 - torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src_boxes), box_cxcywh_to_xyxy(target_boxes)))
        losses['loss_giou'] = loss_giou.sum() / num_boxes
        return losses

    def _get_src_permutation_idx(self, indices):
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for (src, _) in indices])
        return batch_idx, src_idx

    def get_loss(self, loss, outputs, targets, indices, num_boxes, **kwargs):
        loss_map = {'labels': self.loss_labels, 'cardinality': self.loss_cardinality, 'boxes': self.loss_boxes}
        return loss_map[loss](outputs, targets, indices, num_boxes, **kwargs)

    def forward(self, outputs, targets):
        outputs_without_aux = {k: v for k, v in outputs.items() if k != 'aux_outputs'}
        indices = self.matcher(outputs_without_aux, targets)
        num_boxes = sum(len(t["labels"]) for t in targets)
        num_boxes = torch.as_tensor([num_boxes], dtype=torch.float)
        num_boxes = torch.clamp(num_boxes / 1, min=1).item()
        losses = {}
        for loss in self.losses:
            losses.update(self.get_loss(loss, outputs, targets, indices, num_boxes))
        if 'aux_outputs' in outputs:
            for i, aux_outputs in enumerate(outputs['aux_outputs']):
                indices = self.matcher(aux_outputs, targets)
                for loss in self.losses:
                    kwargs = {'log': False} if loss == 'labels' else {}
                    l_dict = self.get_loss(loss, aux_outputs, targets, indices, num_boxes, **kwargs)
                    losses.update({k + f'_{i}': v for k, v in l_dict.items()})
        return losses


class Detr(nn.Module):
    def __init__(self):
        super().__init__()
        self.query_embed = nn.Embedding(Q, D)
        self.layers = nn.ModuleList(nn.Linear(2 * D, D) for _ in range(LAYERS))
        self.class_embed = nn.Linear(D, C + 1)
        self.bbox_embed = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 4))

    def forward(self, samples):
        memory = samples.mean(1, keepdim=True).expand(-1, Q, -1)
        tgt, hs = torch.zeros_like(memory), []
        for layer in self.layers:
            tgt = torch.relu(layer(torch.cat([tgt + self.query_embed.weight, memory], -1)))
            hs.append(tgt)
        hs = torch.stack(hs)
        outputs_class = self.class_embed(hs)
        outputs_coord = self.bbox_embed(hs).sigmoid()
        out = {'pred_logits': outputs_class[-1], 'pred_boxes': outputs_coord[-1]}
        out['aux_outputs'] = [{'pred_logits': a, 'pred_boxes': b}
                              for a, b in zip(outputs_class[:-1], outputs_coord[:-1])]
        return out


weight_dict = {'loss_ce': 1, 'loss_bbox': 5, 'loss_giou': 2}
aux_weight_dict = {}
for i in range(LAYERS - 1):
    aux_weight_dict.update({k + f'_{i}': v for k, v in weight_dict.items()})
weight_dict.update(aux_weight_dict)
model = Detr()
criterion = SetCriterion(C, HungarianMatcher(), weight_dict, 0.1, ['labels', 'boxes', 'cardinality'])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
meters = {}
history = []
for step in range(STEPS):
    samples = torch.randn(2, 6, D)
    targets = []
    for n in (2, 3):
        centers, sizes = torch.rand(n, 2) * 0.5 + 0.25, torch.rand(n, 2) * 0.2 + 0.05
        targets.append({'labels': torch.randint(0, C, (n,)), 'boxes': torch.cat([centers, sizes], 1)})
    outputs = model(samples)
    loss_dict = criterion(outputs, targets)
    weight_dict = criterion.weight_dict
    losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in weight_dict)
    loss_dict_reduced = loss_dict  # utils.reduce_dict with one process
    loss_dict_reduced_unscaled = {f'{k}_unscaled': v for k, v in loss_dict_reduced.items()}
    loss_dict_reduced_scaled = {k: v * weight_dict[k] for k, v in loss_dict_reduced.items() if k in weight_dict}
    losses_reduced_scaled = sum(loss_dict_reduced_scaled.values())
    loss_value = losses_reduced_scaled.item()
    if not math.isfinite(loss_value):
        raise SystemExit(1)
    optimizer.zero_grad()
    losses.backward()
    if MAX_NORM > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    for k, v in dict(loss=loss_value, **loss_dict_reduced_scaled, **loss_dict_reduced_unscaled,
                     class_error=loss_dict_reduced['class_error']).items():
        meters.setdefault(k, []).append(v.item() if isinstance(v, torch.Tensor) else v)
    history.append(loss_dict)
    print(step, repr(loss_value), repr(meters['class_error'][-1]))
print("checksum", repr(sum(p.double().sum().item() for p in model.parameters())))
