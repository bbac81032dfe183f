"""The ``fit_one_cycle`` loop of Jovian's "Deep Learning with PyTorch: Zero to GANs" (lesson 5, notebook
05b-cifar10-resnet by Aakash N S: ``ImageClassificationBase``, ``conv_block``, ``ResNet9``, ``accuracy``,
``evaluate``, ``get_lr``, ``fit_one_cycle``), copied verbatim into many repositories (the search corpus holds
eight copies).

- Adam with weight decay, ``OneCycleLR(max_lr, epochs, steps_per_epoch=len(train_loader))`` stepped after every
  batch (Adam's ``betas[0]`` cycled as momentum), gradients clipped by *value* (``clip_grad_value_``) before the
  step, ``zero_grad`` after it, the rate recorded before the schedule moves it;
- a ResNet9 with BatchNorm, in-place ReLU and residual sums ``res1(out) + out``, dropout before the classifier;
- an evaluation after every epoch (``validation_step`` dicts, ``validation_epoch_end`` stacking them) under
  ``no_grad``;
- ``train_losses.append(loss)``: every batch's loss kept, *with its graph*, until the epoch's
  ``torch.stack(train_losses).mean().item()``. The graphs of a whole epoch (their saved activations) stay alive:
  the memory mistake of PyTorch's FAQ ("Don't accumulate history across your training loop"). ``watch`` names
  ``train_losses`` with a ``GraphLeakWarning``, the computation unchanged; with the fix its message gives
  (``train_losses.append(loss.detach())``) the loop runs clean.

Changes for a seconds-long test: ResNet9's widths 4 and 8 (64 to 512) on 8x8 images (32x32), its
``MaxPool2d(4)`` before the classifier as ``MaxPool2d(1)`` (the map is 1x1 here), 3 epochs of 3 batches of 4,
the validation set the training batches; ``epoch_end``'s print left out; ``to_device`` and the
``DeviceDataLoader`` left out (CPU).

The port: ``training_step`` is the model's, ``on_before_optimizer_step`` clips by value, the ``OneCycleLR`` has
``interval: step``; the epoch's train loss is the mean of what ``on_step_end`` gets (detached), and the rates of
the epoch are read there too.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import GraphGuard, GraphLeakWarning, Trainer
from safeloop.watch import Watch

from .harness import assert_same, checks, compare_runs

EPOCHS, BATCHES, BATCH, MAX_LR, GRAD_CLIP, WEIGHT_DECAY = 3, 3, 4, 0.01, 0.1, 1e-4


# -- the notebook's model -----------------------------------------------------------------------------------
def accuracy(outputs, labels):
    _, preds = torch.max(outputs, dim=1)
    return torch.tensor(torch.sum(preds == labels).item() / len(preds))


class ImageClassificationBase(nn.Module):
    def training_step(self, batch):
        images, labels = batch
        out = self(images)                  # Generate predictions
        loss = F.cross_entropy(out, labels)  # Calculate loss
        return loss

    def validation_step(self, batch):
        images, labels = batch
        out = self(images)                    # Generate predictions
        loss = F.cross_entropy(out, labels)   # Calculate loss
        acc = accuracy(out, labels)           # Calculate accuracy
        return {'val_loss': loss.detach(), 'val_acc': acc}

    def validation_epoch_end(self, outputs):
        batch_losses = [x['val_loss'] for x in outputs]
        epoch_loss = torch.stack(batch_losses).mean()   # Combine losses
        batch_accs = [x['val_acc'] for x in outputs]
        epoch_acc = torch.stack(batch_accs).mean()      # Combine accuracies
        return {'val_loss': epoch_loss.item(), 'val_acc': epoch_acc.item()}

    def epoch_end(self, epoch, result):
        """The notebook prints the epoch's result here; a test prints nothing."""


def conv_block(in_channels, out_channels, pool=False):
    layers = [nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
              nn.BatchNorm2d(out_channels),
              nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class ResNet9(ImageClassificationBase):
    def __init__(self, in_channels=3, num_classes=3):
        super().__init__()

        self.conv1 = conv_block(in_channels, 4)
        self.conv2 = conv_block(4, 8, pool=True)
        self.res1 = nn.Sequential(conv_block(8, 8), conv_block(8, 8))

        self.conv3 = conv_block(8, 8, pool=True)
        self.conv4 = conv_block(8, 8, pool=True)
        self.res2 = nn.Sequential(conv_block(8, 8), conv_block(8, 8))

        self.classifier = nn.Sequential(nn.MaxPool2d(1),
                                        nn.Flatten(),
                                        nn.Dropout(0.2),
                                        nn.Linear(8, num_classes))

    def forward(self, xb):
        out = self.conv1(xb)
        out = self.conv2(out)
        out = self.res1(out) + out
        out = self.conv3(out)
        out = self.conv4(out)
        out = self.res2(out) + out
        out = self.classifier(out)
        return out


# -- the notebook's loop ------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, val_loader):
    model.eval()
    outputs = [model.validation_step(batch) for batch in val_loader]
    return model.validation_epoch_end(outputs)


def get_lr(optimizer):
    for param_group in optimizer.param_groups:
        return param_group['lr']


def fit_one_cycle(epochs, max_lr, model, train_loader, val_loader,
                  weight_decay=0, grad_clip=None, opt_func=torch.optim.SGD):
    history = []

    # Set up cutom optimizer with weight decay
    optimizer = opt_func(model.parameters(), max_lr, weight_decay=weight_decay)
    # Set up one-cycle learning rate scheduler
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr, epochs=epochs,
                                                steps_per_epoch=len(train_loader))

    for epoch in range(epochs):
        # Training Phase
        model.train()
        train_losses = []
        lrs = []
        for batch in train_loader:
            loss = model.training_step(batch)
            train_losses.append(loss)
            loss.backward()

            # Gradient clipping
            if grad_clip:
                nn.utils.clip_grad_value_(model.parameters(), grad_clip)

            optimizer.step()
            optimizer.zero_grad()

            # Record & update learning rate
            lrs.append(get_lr(optimizer))
            sched.step()

        # Validation phase
        result = evaluate(model, val_loader)
        result['train_loss'] = torch.stack(train_losses).mean().item()
        result['lrs'] = lrs
        model.epoch_end(epoch, result)
        history.append(result)
    return history


def fit_one_cycle_detached(epochs, max_lr, model, train_loader, val_loader,
                           weight_decay=0, grad_clip=None, opt_func=torch.optim.SGD):
    """``fit_one_cycle`` with the fix ``watch`` gives: ``train_losses.append(loss.detach())``."""
    history = []
    optimizer = opt_func(model.parameters(), max_lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr, epochs=epochs,
                                                steps_per_epoch=len(train_loader))
    for epoch in range(epochs):
        model.train()
        train_losses = []
        lrs = []
        for batch in train_loader:
            loss = model.training_step(batch)
            train_losses.append(loss.detach())
            loss.backward()
            if grad_clip:
                nn.utils.clip_grad_value_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad()
            lrs.append(get_lr(optimizer))
            sched.step()
        result = evaluate(model, val_loader)
        result['train_loss'] = torch.stack(train_losses).mean().item()
        result['lrs'] = lrs
        model.epoch_end(epoch, result)
        history.append(result)
    return history


def hand(fit):
    def run(model, loader):
        loader.history = fit(EPOCHS, MAX_LR, model, loader, loader, grad_clip=GRAD_CLIP,
                             weight_decay=WEIGHT_DECAY, opt_func=torch.optim.Adam)
    return run


class OneCycle(Trainer):
    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.model.parameters(), MAX_LR, weight_decay=WEIGHT_DECAY)
        sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, MAX_LR, epochs=EPOCHS,
                                                    steps_per_epoch=len(self.train_data))
        self.history, self.train_losses, self.lrs = [], [], []
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def training_step(self, batch):
        return self.model.training_step(batch)

    def on_before_optimizer_step(self, name, optimizer):
        nn.utils.clip_grad_value_(self.model.parameters(), GRAD_CLIP)
        self.lrs.append(get_lr(optimizer))

    def on_step_end(self, losses):
        self.train_losses.append(losses["loss"])

    def on_epoch_end(self):
        result = evaluate(self.model, self.train_data)
        result['train_loss'] = torch.stack(self.train_losses).mean().item()
        result['lrs'] = self.lrs
        self.history.append(result)
        self.train_losses, self.lrs = [], []
        self.model.train()

    def on_fit_end(self):
        self.train_data.history = self.history


class Loader(list):
    """The batches, and the history a run leaves on them."""


def images():
    gen = torch.Generator().manual_seed(4)
    return Loader((torch.randn(BATCH, 3, 8, 8, generator=gen), torch.randint(3, (BATCH,), generator=gen))
                  for _ in range(BATCHES))


@pytest.mark.parametrize("check", checks())
def test_one_cycle_with_value_clipping_and_the_epoch_loss_from_detached_losses(check):
    runs = compare_runs(ResNet9, hand(fit_one_cycle_detached), OneCycle, images, check, steps=EPOCHS * BATCHES)
    assert runs[0].history == runs[1].history == runs[2].history
    assert len({lr for result in runs[0].history for lr in result['lrs']}) == EPOCHS * BATCHES


@pytest.mark.parametrize("check", ["auto", "always"])
def test_the_losses_kept_with_their_graphs_for_the_epoch_mean_are_named(check):
    torch.manual_seed(0)
    ref = ResNet9()
    watched = ResNet9()
    watched.load_state_dict(ref.state_dict())
    torch.manual_seed(1)
    hand(fit_one_cycle_detached)(ref, images())
    torch.manual_seed(1)
    with pytest.warns(GraphLeakWarning, match=r"held by `local train_losses\[0\]`\), made from the graph of a "
                                              r"loss of their step, or that loss itself") as caught:
        with Watch(GraphGuard(check=check), fit_one_cycle.__code__.co_filename):
            hand(fit_one_cycle)(watched, images())
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert "torch.no_grad()" not in leak.fixes[0] and "`train_losses.append(x.detach())`" in leak.fixes[0]
    assert_same(watched, ref)
