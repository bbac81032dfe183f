"""Adversarial weight perturbation under bf16 autocast: lonePatient/TorchBlocks at commit
5e941061e714445d54468703279f55041919dff3, torchblocks/callback/adversarial/awp.py (``AWP``: ``attack`` moves every
``weight`` with a gradient along it, ``param.data.add_(r_at)``, then rebinds ``param.data`` to the result clamped to
``epsilon * |w|`` around the saved weights; ``restore`` rebinds ``param.data`` to them), used as such classes are
used in Kaggle loops: the clean forward under ``autocast`` and its ``backward()``, ``awp.attack(is_first_attack=True)``,
the adversarial forward under a second ``autocast`` region and its ``backward()`` (adding to the clean gradients),
``awp.restore()``, then ``optimizer.step()`` and ``zero_grad()``. PyTorch's AMP docs say to wrap only the forward
passes in ``autocast``: each forward gets its own region, so the adversarial one casts the perturbed weights.

Changes for a seconds-long test: an MLP of two ``nn.Linear`` and a ``Tanh`` (a transformer), regression by
``mse_loss``, 5 batches of 8, AdamW; ``epsilon`` 0.1 (0.001) so that the perturbation shows in bfloat16; the CPU:
``torch.autocast("cpu", dtype=torch.bfloat16)``.

The port: manual mode, ``precision="bf16-mixed"``, ``self.backward`` for both losses and ``self.step()``.
``training_step`` runs inside one autocast region, whose cache of bfloat16 weight copies ``self.backward`` and
``self.step`` clear: the adversarial forward after the attack casts the perturbed weights, as the loop's second
region does, and the port matches the loop bit for bit as written, and with a ``torch.clear_autocast_cache()`` of
its own after ``attack``.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import batches, checks, compare, fixed


class AWP(object):
    """ [Adversarial weight perturbation helps robust generalization](https://arxiv.org/abs/2004.05884)
    """
    def __init__(
        self,
        model,
        emb_name="weight",
        epsilon=0.001,
        alpha=1.0,
    ):
        self.model = model
        self.emb_name = emb_name
        self.epsilon = epsilon
        self.alpha = alpha
        self.param_backup = {}
        self.param_backup_eps = {}
        self.grad_backup = {}

    def attack(self, is_first_attack=False):
        if self.alpha == 0: return  # noqa: E701
        e = 1e-6
        for name, param in self.model.named_parameters():
            if param.requires_grad and param.grad is not None and self.emb_name in name:
                # save
                if is_first_attack:
                    self.param_backup[name] = param.data.clone()
                    grad_eps = self.epsilon * param.abs().detach()
                    self.param_backup_eps[name] = (
                        self.param_backup[name] - grad_eps,
                        self.param_backup[name] + grad_eps,
                    )
                # attack
                norm1 = torch.norm(param.grad)
                norm2 = torch.norm(param.data.detach())
                if norm1 != 0 and not torch.isnan(norm1):
                    r_at = self.alpha * param.grad / (norm1 + e) * (norm2 + e)
                    param.data.add_(r_at)
                    param.data = torch.min(
                        torch.max(
                            param.data,
                            self.param_backup_eps[name][0]
                        ),
                        self.param_backup_eps[name][1]
                    )

    def restore(self):
        for name, param in self.model.named_parameters():
            if name in self.param_backup:
                param.data = self.param_backup[name]
        self.param_backup = {}
        self.param_backup_eps = {}


EPSILON = 0.1


def make_model():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def awp_hand(model, loader):
    optimizer = make_optimizer(model.parameters())
    awp = AWP(model, epsilon=EPSILON)
    for x, y in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x), y)
        loss.backward()
        awp.attack(is_first_attack=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            adv_loss = F.mse_loss(model(x), y)
        adv_loss.backward()
        awp.restore()
        optimizer.step()
        optimizer.zero_grad()


def awp_hand_fp16(model, loader):
    """The same loop under float16 autocast with a ``GradScaler``, as PyTorch's AMP examples scale each backward."""
    optimizer = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    awp = AWP(model, epsilon=EPSILON)
    for x, y in loader:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        awp.attack(is_first_attack=True)
        with torch.autocast("cpu", dtype=torch.float16):
            adv_loss = F.mse_loss(model(x), y)
        scaler.scale(adv_loss).backward()
        awp.restore()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


class AWPTrainer(Trainer):
    automatic = False
    clear_cache = False

    def on_fit_start(self):
        self.awp = AWP(self.model, epsilon=EPSILON)

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        self.awp.attack(is_first_attack=True)
        if self.clear_cache:
            torch.clear_autocast_cache()  # the weights changed inside training_step's autocast region
        adv_loss = F.mse_loss(self.model(x), y)
        self.backward(adv_loss)
        self.awp.restore()
        self.step()
        return {"clean": loss, "adv": adv_loss}


class AWPTrainerClearingTheCache(AWPTrainer):
    clear_cache = True


def data():
    return fixed(batches(5, (8, 4), (8, 2), seed=9))


@pytest.mark.parametrize("check", checks())
def test_awp_under_bf16_with_the_autocast_cache_cleared_after_the_attack(check):
    compare(make_model, awp_hand, AWPTrainerClearingTheCache, data(), check, steps=5, optimizer=make_optimizer,
            precision="bf16-mixed")


@pytest.mark.parametrize("check", checks())
def test_awp_under_bf16_as_the_loop_writes_it(check):
    """Without a cache clearing of the port's own: had the clean forward's bfloat16 copies stayed in the cache, the
    adversarial loss would be taken at the unperturbed weights, and the port would train otherwise, silently."""
    compare(make_model, awp_hand, AWPTrainer, data(), check, steps=5, optimizer=make_optimizer,
            precision="bf16-mixed")


@pytest.mark.parametrize("check", checks())
def test_awp_under_float16_with_a_grad_scaler_as_the_loop_writes_it(check):
    """``precision="16-mixed"``: the same clearing after ``self.backward``, the losses scaled as the loop scales them."""
    compare(make_model, awp_hand_fp16, AWPTrainer, data(), check, steps=5, optimizer=make_optimizer,
            precision="16-mixed")


def test_the_perturbation_changes_the_adversarial_loss():
    torch.manual_seed(0)
    model = make_model()
    x, y = batches(1, (8, 4), (8, 2), seed=9)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x), y)
    loss.backward()
    AWP(model, epsilon=EPSILON).attack(is_first_attack=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.mse_loss(model(x), y) != loss
