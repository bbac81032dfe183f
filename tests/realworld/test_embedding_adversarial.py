"""Adversarial training on word embeddings (FGM and PGD), the pattern copied into many text-classification
repositories: yangyubuaa/Adversarial_Training, fgm.py at commit 79315459d63c8126f76edcddcf3a494141c544e2, pgd.py and
pgd_framework.py at commit 3435d2015a0d7e9bf57b7e5617de586a1ac31954, train_framework.py at commit
58bb94650d78851c551d95ccefc610e7196d65e6.

FGM: the clean loss is back-propagated, the embedding matrix itself is moved along its gradient through
``param.data.add_`` (its value backed up by ``param.data.clone()``), the loss of a second forward through the moved
embedding is back-propagated onto the same ``.grad`` (accumulated on purpose), the embedding is put back by
rebinding ``param.data`` to the backup (new storage), and the optimizer steps. PGD: the same for K=3 steps, each
projected into an epsilon-ball around the backup (``param.data = self.project(...)``); every parameter's gradient
is cloned (``backup_grad``), the model's gradients are cleared by ``model.zero_grad()`` between attack steps, and
the clean gradients are assigned back by hand (``param.grad = self.grad_backup[name]``) before the last adversarial
backward. ``model.zero_grad()`` after each update.

Changes for a seconds-long test: the framework leaves the model, data and optimizer open: a text classifier with
an ``emb`` embedding (16 words of 4 dimensions), a GRU of 4 and a linear head returning the cross-entropy of its
logits (``model(batch_input, batch_label)``), Adam, 4 batches of 3 sentences of 5 tokens.

The ports are manual (two and four backwards into one optimizer, the embedding moved between them):
``self.backward`` where the loop calls ``backward``, the attack objects as they are, ``self.step()``.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare

VOCAB, DIM, CLASSES, STEPS, K = 16, 4, 3, 4, 3


# -- fgm.py -------------------------------------------------------------------------------------------------
class FGM():
    def __init__(self, model):
        self.model = model
        self.backup = {}

    def attack(self, epsilon=1., emb_name='emb.'):
        # emb_name这个参数要换成你模型中embedding的参数名
        for name, param in self.model.named_parameters():
            if param.requires_grad and emb_name in name:
                self.backup[name] = param.data.clone()
                norm = torch.norm(param.grad)
                if norm != 0 and not torch.isnan(norm):
                    r_at = epsilon * param.grad / norm
                    param.data.add_(r_at)

    def restore(self, emb_name='emb.'):
        # emb_name这个参数要换成你模型中embedding的参数名
        for name, param in self.model.named_parameters():
            if param.requires_grad and emb_name in name:
                assert name in self.backup
                param.data = self.backup[name]
        self.backup = {}


# -- pgd.py -------------------------------------------------------------------------------------------------
class PGD():
    def __init__(self, model):
        self.model = model
        self.emb_backup = {}
        self.grad_backup = {}

    def attack(self, epsilon=1., alpha=0.3, emb_name='emb.', is_first_attack=False):
        # emb_name这个参数要换成你模型中embedding的参数名
        for name, param in self.model.named_parameters():
            if param.requires_grad and emb_name in name:
                if is_first_attack:
                    self.emb_backup[name] = param.data.clone()
                norm = torch.norm(param.grad)
                if norm != 0:
                    r_at = alpha * param.grad / norm
                    param.data.add_(r_at)
                    param.data = self.project(name, param.data, epsilon)

    def restore(self, emb_name='emb.'):
        # emb_name这个参数要换成你模型中embedding的参数名
        for name, param in self.model.named_parameters():
            if param.requires_grad and emb_name in name:
                assert name in self.emb_backup
                param.data = self.emb_backup[name]
        self.emb_backup = {}

    def project(self, param_name, param_data, epsilon):
        r = param_data - self.emb_backup[param_name]
        if torch.norm(r) > epsilon:
            r = epsilon * r / torch.norm(r)
        return self.emb_backup[param_name] + r

    def backup_grad(self):
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                self.grad_backup[name] = param.grad.clone()

    def restore_grad(self):
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                param.grad = self.grad_backup[name]


class TextClassifier(nn.Module):
    """The framework's ``model(batch_input, batch_label)``, which returns the loss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.rnn = nn.GRU(DIM, DIM, batch_first=True)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, batch_input, batch_label):
        _, h = self.rnn(self.emb(batch_input))
        return F.cross_entropy(self.head(h[-1]), batch_label)


def make_optimizer(params):
    return torch.optim.Adam(params, lr=1e-2)


# -- train_framework.py -------------------------------------------------------------------------------------
def fgm_hand(model, data):
    optimizer = make_optimizer(model.parameters())
    # 初始化
    fgm = FGM(model)
    for batch_input, batch_label in data:
        # 正常训练
        loss = model(batch_input, batch_label)
        loss.backward()  # 反向传播，得到正常的grad
        # 对抗训练
        fgm.attack()  # 在embedding上添加对抗扰动
        loss_adv = model(batch_input, batch_label)
        loss_adv.backward()  # 反向传播，并在正常的grad基础上，累加对抗训练的梯度
        fgm.restore()  # 恢复embedding参数
        # 梯度下降，更新参数
        optimizer.step()
        model.zero_grad()


# -- pgd_framework.py ---------------------------------------------------------------------------------------
def pgd_hand(model, data):
    optimizer = make_optimizer(model.parameters())
    pgd = PGD(model)
    for batch_input, batch_label in data:
        # 正常训练
        loss = model(batch_input, batch_label)
        loss.backward()  # 反向传播，得到正常的grad
        pgd.backup_grad()
        # 对抗训练
        for t in range(K):
            pgd.attack(is_first_attack=(t == 0))  # 在embedding上添加对抗扰动, first attack时备份param.data
            if t != K-1:
                model.zero_grad()
            else:
                pgd.restore_grad()
            loss_adv = model(batch_input, batch_label)
            loss_adv.backward()  # 反向传播，并在正常的grad基础上，累加对抗训练的梯度
        pgd.restore()  # 恢复embedding参数
        # 梯度下降，更新参数
        optimizer.step()
        model.zero_grad()


class FGMTrainer(Trainer):
    automatic = False

    def on_fit_start(self):
        self.fgm = FGM(self.model)

    def training_step(self, batch):
        batch_input, batch_label = batch
        loss = self.model(batch_input, batch_label)
        self.backward(loss)
        self.fgm.attack()
        loss_adv = self.model(batch_input, batch_label)
        self.backward(loss_adv)
        self.fgm.restore()
        self.step()
        return loss


class PGDTrainer(Trainer):
    automatic = False

    def on_fit_start(self):
        self.pgd = PGD(self.model)

    def training_step(self, batch):
        batch_input, batch_label = batch
        loss = self.model(batch_input, batch_label)
        self.backward(loss)
        self.pgd.backup_grad()
        for t in range(K):
            self.pgd.attack(is_first_attack=(t == 0))
            if t != K-1:
                self.model.zero_grad()
            else:
                self.pgd.restore_grad()
            loss_adv = self.model(batch_input, batch_label)
            self.backward(loss_adv)
        self.pgd.restore()
        self.step()
        return loss


def sentences(model):
    gen = torch.Generator().manual_seed(14)
    return [(torch.randint(VOCAB, (3, 5), generator=gen), torch.randint(CLASSES, (3,), generator=gen))
            for _ in range(STEPS)]


@pytest.mark.parametrize("check", checks())
def test_fgm_on_the_embedding_with_two_backwards_into_one_update(check):
    compare(TextClassifier, fgm_hand, FGMTrainer, sentences, check, steps=STEPS, optimizer=make_optimizer)


@pytest.mark.parametrize("check", checks())
def test_pgd_on_the_embedding_with_gradients_backed_up_and_assigned_by_hand(check):
    compare(TextClassifier, pgd_hand, PGDTrainer, sentences, check, steps=STEPS, optimizer=make_optimizer)
