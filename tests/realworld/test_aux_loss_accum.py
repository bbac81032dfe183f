"""Deep supervision with an auxiliary head: hszhao/semseg, model/pspnet.py (``PSPNet.forward`` in training:
the main head's and the auxiliary head's (on layer3's features) cross-entropies returned) and tool/train.py
(``loss = main_loss + args.aux_weight * aux_loss``, ``aux_weight: 0.4`` in config/ade20k/ade20k_pspnet50.yaml).

The source has no accumulation or clipping; here, as a multi-task loop with a shared trunk and heads that reach
disjoint parameters would add them, two micro-batches per step (each loss divided by 2) and
``clip_grad_norm_(1.0)`` before SGD's step.

Changes for a seconds-long test: linear layers over 8 features (a ResNet and a pyramid pooling module), 3
classes, 4 steps. Ports: the two losses returned as a dict with ``loss_weights={'main': 1, 'aux': 0.4}``,
``grad_accum=2`` and ``grad_clip=1.0``, under ``multi_loss="sum"`` and under ``"sequential"`` (against a hand
loop that back-propagates each loss in turn, the first with ``retain_graph=True``).
"""
import pytest
import torch

from safeloop import Trainer

from .harness import checks, compare, fixed

D, C, STEPS, ACCUM, AUX_WEIGHT = 8, 3, 4, 2, 0.4


class PSPNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer3 = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.ReLU())
        self.layer4 = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.ReLU())
        self.cls = torch.nn.Linear(D, C)
        self.aux = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.ReLU(), torch.nn.Linear(D, C))
        self.criterion = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        x_tmp = self.layer3(x)
        x = self.cls(self.layer4(x_tmp))
        aux = self.aux(x_tmp)
        return x.max(1)[1], self.criterion(x, y), self.criterion(aux, y)


def items():
    gen = torch.Generator().manual_seed(6)
    return [(torch.randn(4, D, generator=gen), torch.randint(C, (4,), generator=gen)) for _ in range(STEPS * ACCUM)]


def optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def hand(model, data):
    opt = optimizer(model)
    for i in range(0, len(data), ACCUM):
        opt.zero_grad()
        for x, y in data[i:i + ACCUM]:
            output, main_loss, aux_loss = model(x, y)
            loss = main_loss + AUX_WEIGHT * aux_loss
            (loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def hand_sequential(model, data):
    opt = optimizer(model)
    for i in range(0, len(data), ACCUM):
        opt.zero_grad()
        for x, y in data[i:i + ACCUM]:
            output, main_loss, aux_loss = model(x, y)
            (main_loss / ACCUM).backward(retain_graph=True)
            (AUX_WEIGHT * aux_loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


class Port(Trainer):
    def configure_optimizers(self):
        return optimizer(self.model)

    def training_step(self, batch):
        output, main_loss, aux_loss = self.model(*batch)
        return {'main': main_loss, 'aux': aux_loss}


SETTINGS = dict(loss_weights={'main': 1.0, 'aux': AUX_WEIGHT}, grad_accum=ACCUM, grad_clip=1.0)


@pytest.mark.parametrize("check", checks())
def test_aux_loss_sum(check):
    compare(PSPNet, hand, Port, fixed(items()), check, STEPS, multi_loss="sum", **SETTINGS)


@pytest.mark.parametrize("check", checks())
def test_aux_loss_sequential(check):
    compare(PSPNet, hand_sequential, Port, fixed(items()), check, STEPS, **SETTINGS)
