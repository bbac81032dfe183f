"""Evaluation loops from public code against safeloop's ``validate()``, ``test()`` and ``predict()``, without Lightning:
pytorch/examples' ImageNet ``validate()`` (AverageMeter means weighted by the batch size, top-1 and top-5, eval mode
then train mode again, BatchNorm statistics untouched), its training loop with the validation inside
``torch.random.fork_rng()`` (docs/trainer.md's claim: then a port trains bit for bit as it), an EMA copy validated as
timm's ``ModelEmaV2`` keeps it (in eval mode from its construction) and as a ``copy.deepcopy`` of the model, and the
FGSM attack of pytorch/tutorials in ``validation_step``, and which validations EarlyStopping counts.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import safeloop


def images(n, seed=1, classes=6):
    """Flattened "images" of 10 features and their labels."""
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 10, generator=gen), torch.randint(0, classes, (n,), generator=gen))


def convnet(dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 6))


# -- pytorch/examples, imagenet/main.py (commit 493da9304e56ff5160f78d01a54992db35df2a98): AverageMeter, accuracy()
# and validate() as written there (the progress display, timing, device moves and the distributed "aux" loader left
# out); ResNet on ImageNet reduced to a small MLP with BatchNorm on seeded features, 6 classes.


class AverageMeter:
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


def validate(val_loader, model, criterion):
    losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    model.eval()
    with torch.no_grad():
        for images_, target in val_loader:
            output = model(images_)
            loss = criterion(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses.update(loss.item(), images_.size(0))
            top1.update(acc1[0], images_.size(0))
            top5.update(acc5[0], images_.size(0))
    return {"loss": losses.avg, "top1": float(top1.avg), "top5": float(top5.avg)}


class ImageNet(safeloop.Trainer):
    """main.py's train() step and validate()'s metrics, ported."""

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch):
        x, y = batch
        output = self.model(x)
        acc1, acc5 = accuracy(output, y, topk=(1, 5))
        return {"loss": F.cross_entropy(output, y), "top1": acc1[0], "top5": acc5[0]}


def test_imagenet_validate_matches_the_trainers_validation():
    """50 samples in batches of 16, 16, 16 and 2 (a smaller last batch): ``val_loss`` equals validate()'s
    ``losses.avg`` exactly (both sum each batch's loss times its size in float64, in order); top-1 and top-5 to
    1e-6 (validate() sums them in float32). The model's mode and BatchNorm statistics are as before."""
    model = convnet()
    trainer = ImageNet(model=model, train_data=DataLoader(images(8), batch_size=4), max_steps=1, device="cpu",
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False, loggers=[])
    with torch.no_grad():  # statistics to use: a few batches seen in train mode
        for x, _ in DataLoader(images(64, seed=3), batch_size=16):
            model(x)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    val = DataLoader(images(50, seed=2), batch_size=16)
    trainer.val_data = val
    ours = trainer.validate()
    assert model.training and all(torch.equal(stats[k], v) for k, v in model.state_dict().items())
    theirs = validate(val, model, nn.CrossEntropyLoss())
    model.train()
    assert ours["val_loss"] == theirs["loss"]
    assert ours["val_top1"] == pytest.approx(theirs["top1"], rel=1e-6)
    assert ours["val_top5"] == pytest.approx(theirs["top5"], rel=1e-6)
    assert 0 < ours["val_top1"] < ours["val_top5"] < 100
    assert trainer.state.val_history == [(0, ours)]
    assert trainer.test(val) == {"test_" + k[4:]: v for k, v in ours.items()}  # the default test_step


def test_imagenet_training_with_validation_in_fork_rng_is_bit_identical():
    """docs/trainer.md, Validation: "A hand-written loop that validates moves them (pytorch/examples' imagenet): to
    compare a port with it bit for bit, validate there inside ``torch.random.fork_rng()``". main.py's loop (shuffled
    training data, dropout, SGD with momentum, validate() after each epoch), 3 epochs, validate() inside
    ``fork_rng``; the port validating every pass (and before training and after: nothing the training draws
    changes). The parameters and buffers bit for bit, and each epoch's validation metrics."""
    train, val = images(24), DataLoader(images(10, seed=2), batch_size=4)
    torch.manual_seed(5)
    model = convnet(dropout=0.3)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    loader = DataLoader(train, batch_size=5, shuffle=True)  # passes of 5 batches, the last of 4
    theirs = []
    torch.manual_seed(7)
    for _ in range(3):
        model.train()
        for x, y in loader:
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.random.fork_rng():
            theirs.append(validate(val, model, criterion))

    torch.manual_seed(5)
    port = ImageNet(model=convnet(dropout=0.3), train_data=DataLoader(train, batch_size=5, shuffle=True),
                    val_data=val, optimizer=lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, weight_decay=1e-4),
                    max_epochs=3, val_every=5, device="cpu", progress=False, loggers=[])
    torch.manual_seed(7)
    port.fit()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), port.model.state_dict().values()))
    ours = [m for s, m in port.state.val_history if s]
    assert [s for s, _ in port.state.val_history] == [0, 5, 10, 15]
    assert [m["val_loss"] for m in ours] == [m["loss"] for m in theirs]
    assert [m["val_top1"] for m in ours] == pytest.approx([m["top1"] for m in theirs], rel=1e-6)


# -- an EMA copy validated beside the model. timm (huggingface/pytorch-image-models, timm/utils/model_ema.py, commit
# 0a044bf43ddc280594c6f9237c17b41b7067a26e): ModelEmaV2 deep-copies the model and puts the copy in eval mode once, in
# its __init__; train.py validates it with validate(model_ema, ...), which calls model.eval(). real-stanford/
# diffusion_policy (diffusion_policy/workspace/train_diffusion_unet_lowdim_workspace.py, commit
# 7139ef1860c94bc0a3162cec525806133a3b6003) keeps ``copy.deepcopy(self.model)``, in train mode, and calls
# ``policy.eval()`` on it before validating. Reduced: ModelEmaV2's update (decay * ema + (1 - decay) * model over
# the state dict's floating entries), the copy kept on the Trainer and returned from ``modules()``.


def moved_towards(ema: nn.Module, model: nn.Module, decay: float) -> None:
    with torch.no_grad():
        for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(decay * ema_v + (1. - decay) * model_v)


class ModelEmaV2(nn.Module):
    def __init__(self, model, decay=0.5):
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay = decay

    def update(self, model):
        moved_towards(self.module, model, self.decay)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class WithEMA(ImageNet):
    as_timm = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ema = ModelEmaV2(self.model) if self.as_timm else copy.deepcopy(self.model).requires_grad_(False)

    def modules(self):
        return {"model": self.model, "ema": self.ema}

    def on_step_end(self, losses):
        if self.as_timm:
            self.ema.update(self.model)
        else:
            moved_towards(self.ema, self.model, 0.5)

    def validation_step(self, batch):
        x, y = batch
        return {"loss": F.cross_entropy(self.model(x), y), "ema": F.cross_entropy(self.ema(x), y)}


def ema_run(as_timm):
    """Two steps, then: the EMA's validation loss, validate() of a copy of the EMA (eval mode), and whether the
    validation moved the EMA's BatchNorm statistics."""
    cls = type("EMA", (WithEMA,), {"as_timm": as_timm})
    trainer = cls(model=convnet(), train_data=DataLoader(images(8), batch_size=4), max_steps=2, device="cpu",
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False, loggers=[],
                  val_data=DataLoader(images(10, seed=2), batch_size=4))
    trainer.fit()
    ema = trainer.ema.module if as_timm else trainer.ema
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    metrics = trainer.validate()
    moved = [k for k, v in ema.state_dict().items() if not torch.equal(before[k], v)]
    hand = validate(trainer.val_data, copy.deepcopy(ema), nn.CrossEntropyLoss())
    return metrics["val_ema"], hand["loss"], moved


def test_timm_model_ema_v2_validated_beside_the_model_matches_timm_validate():
    """timm's ModelEmaV2 (its copy in eval mode from the start): the EMA's ``val_ema`` equals validate() of it, and
    the validation leaves its statistics."""
    ours, theirs, moved = ema_run(as_timm=True)
    assert ours == theirs and moved == []


def test_ema_deep_copy_validated_beside_the_model_matches_a_hand_validate():
    """diffusion_policy's ``copy.deepcopy(self.model)`` (in train mode), validated as its workspace does after
    ``policy.eval()``: ``val_ema`` should equal validate() of it, and the validation should leave its statistics
    (docs/trainer.md: validation_step "runs over every batch in eval mode")."""
    ours, theirs, moved = ema_run(as_timm=False)
    assert moved == []
    assert ours == theirs


# -- pytorch/tutorials, beginner_source/fgsm_tutorial.py (commit 03cd4915be50f10014722c35b8b04736c145d199), test():
# the attack's input gradient as written there, ``model.zero_grad(); loss.backward(); data.grad``, in
# ``validation_step`` (robust accuracy as a validation metric; batches instead of single images, no skipping of
# misclassified ones). A hand loop zeroes the gradients before each training backward, so the validation's backward
# changes nothing it trains.


class FGSM(ImageNet):
    attack = "backward"  # as the tutorial; "grad": torch.autograd.grad, which writes no .grad

    def training_step(self, batch):
        loss = super().training_step(batch)
        if not self.automatic:
            self.backward(loss)
            self.step()
        return loss

    def validation_step(self, batch):
        x, y = batch
        with torch.enable_grad():
            x = x.clone().requires_grad_(True)
            loss = F.cross_entropy(self.model(x), y)
            if self.attack == "backward":
                self.model.zero_grad()
                loss.backward()
                grad = x.grad
            else:
                (grad,) = torch.autograd.grad(loss, x)
        adversarial = self.model(x + 0.05 * grad.sign())
        return {"loss": loss.detach(), "robust": (adversarial.argmax(1) == y).float().mean()}


def fgsm_run(automatic, attack="backward", **kwargs):
    """Three steps of SGD with validation every 3 (and before training): the entries of the state dict that differ
    from the hand loop's."""
    train = DataLoader(images(12), batch_size=4)
    cls = type("Port", (FGSM,), {"automatic": automatic, "attack": attack})
    port = cls(model=convnet(), train_data=train, val_data=DataLoader(images(10, seed=2), batch_size=4),
               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), max_steps=3, val_every=3, device="cpu",
               progress=False, loggers=[], **kwargs)
    port.fit()
    model = convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in train:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [k for k, v in model.state_dict().items() if not torch.equal(v, port.model.state_dict()[k])]


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_fgsm_in_validation_step_with_autograd_grad_trains_as_the_hand_loop(automatic):
    """The attack's gradient taken with ``torch.autograd.grad``: bit for bit the hand loop's training."""
    assert fgsm_run(automatic=automatic, attack="grad") == []


def test_fgsm_in_validation_step_trains_as_the_hand_loop():
    assert fgsm_run(automatic=True) == []


@pytest.mark.parametrize("automatic, guard", [(True, {"check": "off"}), (False, None), (False, {"check": "always"})],
                         ids=["automatic, guard off", "manual", "manual, guard always"])
def test_fgsm_in_validation_step_trains_as_the_hand_loop_silently_otherwise(automatic, guard):
    assert fgsm_run(automatic=automatic, **({"guard": guard} if guard else {})) == []


# -- docs/trainer.md, Early stopping: "The validations during training count: every val_every steps, and the one at
# the end of a run whose last step is not among those. A trainer.validate() of your own counts when a hook calls it
# during fit()."


class OwnValidation(ImageNet):
    at: int | None = None  # the step after which on_step_end validates once more, of its own

    def on_step_end(self, losses):
        if self.state.step == self.at:
            self.validate()


def stopped_after(at):
    """A constant validation loss (a linear model, lr 0), ``val_every=4``, ``EarlyStopping(patience=2)``: the step
    training stopped after (best at step 4, then 8 and 12 without improvement: 12)."""
    torch.manual_seed(0)
    trainer = type("Own", (OwnValidation,), {"at": at})(
        model=nn.Linear(10, 6), train_data=DataLoader(images(8), batch_size=4),
        val_data=DataLoader(images(8), batch_size=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.0), max_steps=40,
        val_every=4, device="cpu", progress=False, loggers=[], callbacks=[safeloop.EarlyStopping(patience=2)])
    trainer.fit()
    return trainer.state.step


def test_early_stopping_counts_the_validations_during_training():
    assert stopped_after(None) == 12


def test_early_stopping_counts_a_validate_a_hook_calls_during_fit():
    """The extra validation after step 3 is the best (the loss is constant: the first counted is the best); steps 4 and
    8 do not improve on it: training stops after step 8, not 12."""
    assert stopped_after(3) == 8


