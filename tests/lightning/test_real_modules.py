"""LightningModules from public repositories, each kept as written (tiny sizes), ported to safeloop as
docs/trainer.md's "Coming from Lightning" tells, trained on the same seeded data by both."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")

import safeloop  # noqa: E402

from .common import assert_same, lightning, max_diff, settings  # noqa: E402

# -- Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/generative_adversarial_net.py,
# commit 87c3101cec286aeceb8a6b3530c3897b83f40b98: Generator, Discriminator, GAN as written there (``lightning``
# imports as ``pytorch_lightning``; the image logging of ``on_train_epoch_end`` left out: it needs a logger).


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 100, img_shape: tuple = (1, 28, 28)):
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False),
            *block(128, 256),
            *block(256, 512),
            *block(512, 1024),
            nn.Linear(1024, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z):
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape):
        super().__init__()

        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 512),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(512, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 1),
        )

    def forward(self, img):
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)


class GAN(pl.LightningModule):
    def __init__(
        self,
        img_shape: tuple = (1, 28, 28),
        lr: float = 0.0002,
        b1: float = 0.5,
        b2: float = 0.999,
        latent_dim: int = 100,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        # networks
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)

        self.validation_z = torch.randn(8, self.hparams.latent_dim)

        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch

        opt_g, opt_d = self.optimizers()

        # sample noise
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # Train generator
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # Train discriminator
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        d_loss = (real_loss + fake_loss) / 2

        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d


IMG, LATENT = (1, 4, 4), 8


class Nets(nn.Module):
    """The GAN's two networks, made in its order from the same seed: the port's model."""

    def __init__(self):
        super().__init__()
        self.generator = Generator(latent_dim=LATENT, img_shape=IMG)
        self.discriminator = Discriminator(img_shape=IMG)


class PortGAN(safeloop.Trainer):
    """``GAN`` ported: ``automatic = False``; ``self.manual_backward`` and ``opt.step()`` with ``zero_grad`` as
    ``self.backward(loss, optimizer=name)`` and ``self.step(name)``; ``self.log_dict`` kept;
    ``toggle_optimizer`` dropped (``self.backward(optimizer=...)`` reaches only that optimizer's parameters)."""

    automatic = False
    lr, b1, b2 = 0.0002, 0.5, 0.999

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.model.generator.parameters(), lr=self.lr, betas=(self.b1, self.b2))
        opt_d = torch.optim.Adam(self.model.discriminator.parameters(), lr=self.lr, betas=(self.b1, self.b2))
        return {"g": opt_g, "d": opt_d}

    def training_step(self, batch):
        imgs, _ = batch
        z = torch.randn(imgs.shape[0], LATENT).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = GAN.adversarial_loss(self.model.discriminator(self.model.generator(z)), valid)
        self.backward(g_loss, optimizer="g")
        self.step("g")
        real_loss = GAN.adversarial_loss(self.model.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = GAN.adversarial_loss(self.model.discriminator(self.model.generator(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.backward(d_loss, optimizer="d")
        self.step("d")
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})
        return {"g": g_loss, "d": d_loss}


def images(n=12, batch=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.rand(n, *IMG, generator=gen) * 2 - 1, torch.zeros(n)), batch_size=batch)


def test_lightning_example_gan_matches():
    """Two epochs of 3 batches: generator (with BatchNorm's running statistics) and discriminator, bit for bit."""
    torch.manual_seed(0)
    lit = GAN(img_shape=IMG, latent_dim=LATENT)
    torch.manual_seed(0)
    nets = Nets()
    port = PortGAN(model=nets, train_data=images(), **settings(max_epochs=2))
    torch.manual_seed(3)
    lightning(max_epochs=2).fit(lit, train_dataloaders=images())
    torch.manual_seed(3)
    port.fit()
    assert_same(lit.generator, port.model.generator)
    assert_same(lit.discriminator, port.model.discriminator)


# -- Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/computer_vision_fine_tuning.py,
# commit 67f280be1e9f831a96b4f1a97eb45a6ecdb378c3: MilestonesFinetuning and TransferLearningModel as written there,
# but for the backbone (a small MLP with BatchNorm in place of the pretrained ResNet50, its output 2048 wide as
# the ResNet's) and the accuracy metric (torchmetrics is not installed; it does not touch training).

from pytorch_lightning.callbacks import BaseFinetuning  # noqa: E402
from torch.optim.lr_scheduler import MultiStepLR  # noqa: E402


class MilestonesFinetuning(BaseFinetuning):
    def __init__(self, milestones: tuple = (5, 10), train_bn: bool = False):
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    def freeze_before_training(self, pl_module):
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, pl_module, epoch: int, optimizer):
        if epoch == self.milestones[0]:
            # unfreeze 5 last layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[-5:], optimizer=optimizer, train_bn=self.train_bn
            )

        elif epoch == self.milestones[1]:
            # unfreeze remaining layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[:-5], optimizer=optimizer, train_bn=self.train_bn
            )


def backbone():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.ReLU(), nn.Linear(16, 2048))


class TransferLearningModel(pl.LightningModule):
    def __init__(self, train_bn: bool = False, milestones: tuple = (2, 4), lr: float = 1e-3,
                 lr_scheduler_gamma: float = 1e-1):
        super().__init__()
        self.train_bn = train_bn
        self.milestones = milestones
        self.lr = lr
        self.lr_scheduler_gamma = lr_scheduler_gamma
        self.__build_model()

    def __build_model(self):
        self.feature_extractor = backbone()
        _fc_layers = [nn.Linear(2048, 256), nn.ReLU(), nn.Linear(256, 32), nn.Linear(32, 1)]
        self.fc = nn.Sequential(*_fc_layers)
        self.loss_func = F.binary_cross_entropy_with_logits

    def forward(self, x):
        x = self.feature_extractor(x)
        x = x.squeeze(-1).squeeze(-1)
        return self.fc(x)

    def loss(self, logits, labels):
        return self.loss_func(input=logits, target=labels)

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_logits = self.forward(x)
        y_true = y.view((-1, 1)).type_as(x)
        train_loss = self.loss(y_logits, y_true)
        return train_loss

    def configure_optimizers(self):
        parameters = list(self.parameters())
        trainable_parameters = list(filter(lambda p: p.requires_grad, parameters))
        optimizer = torch.optim.Adam(trainable_parameters, lr=self.lr)
        scheduler = MultiStepLR(optimizer, milestones=self.milestones, gamma=self.lr_scheduler_gamma)
        return [optimizer], [scheduler]


class Transfer(nn.Module):
    """The port's model: the same layers, made in the same order."""

    def __init__(self):
        super().__init__()
        self.feature_extractor = backbone()
        self.fc = nn.Sequential(nn.Linear(2048, 256), nn.ReLU(), nn.Linear(256, 32), nn.Linear(32, 1))

    def forward(self, x):
        return self.fc(self.feature_extractor(x).squeeze(-1).squeeze(-1))


class PortFinetuning(safeloop.Callback):
    """``MilestonesFinetuning`` ported: hooks get the trainer; Lightning's ``setup`` freeze in ``on_fit_start``,
    ``on_train_epoch_start`` as ``on_epoch_start``; BaseFinetuning's static helpers kept."""

    def __init__(self, milestones, train_bn=False):
        self.milestones, self.train_bn = milestones, train_bn

    def on_fit_start(self, trainer):
        BaseFinetuning.freeze(modules=trainer.model.feature_extractor, train_bn=self.train_bn)

    def on_epoch_start(self, trainer):
        optimizer = trainer.optimizers["optimizer"] if "optimizer" in trainer.optimizers else \
            next(iter(trainer.optimizers.values()))
        extractor = trainer.model.feature_extractor
        if trainer.state.epoch == self.milestones[0]:
            BaseFinetuning.unfreeze_and_add_param_group(modules=extractor[-5:], optimizer=optimizer,
                                                        train_bn=self.train_bn)
        elif trainer.state.epoch == self.milestones[1]:
            BaseFinetuning.unfreeze_and_add_param_group(modules=extractor[:-5], optimizer=optimizer,
                                                        train_bn=self.train_bn)


class PortTransfer(safeloop.Trainer):
    milestones, lr, gamma = (1, 2), 1e-3, 1e-1

    def training_step(self, batch):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.model(x), y.view((-1, 1)).type_as(x))

    def configure_optimizers(self):
        trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(trainable_parameters, lr=self.lr)
        return {"optimizer": optimizer, "lr_scheduler": MultiStepLR(optimizer, milestones=self.milestones,
                                                                       gamma=self.gamma)}


def labelled(n=12, batch=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).float()), batch_size=batch)


def transfer_runs(freeze_first=False):
    torch.manual_seed(0)
    lit = TransferLearningModel(milestones=(1, 2))
    lightning(max_epochs=3, callbacks=[MilestonesFinetuning(milestones=(1, 2))]).fit(
        lit, train_dataloaders=labelled())
    torch.manual_seed(0)
    model = Transfer()
    if freeze_first:
        BaseFinetuning.freeze(modules=model.feature_extractor, train_bn=False)
    port = PortTransfer(model=model, train_data=labelled(), callbacks=[PortFinetuning((1, 2))],
                        **settings(max_epochs=3))
    port.fit()
    return lit, port


def test_lightning_example_finetuning_freeze_in_on_fit_start_differs_as_documented():
    """MilestonesFinetuning freezes the backbone in ``setup`` (``freeze_before_training``), before Lightning calls
    ``configure_optimizers``; safeloop's ``on_fit_start`` runs after ``fit()`` made the optimizers (docs/trainer.md):
    Lightning's optimizer ends with three groups (the head at 1e-5, each unfrozen part at 1e-6), the port's with one
    group of 16 parameters, the backbone trained at the head's rate."""
    lit, port = transfer_runs()
    assert [len(g["params"]) for g in lit.trainer.optimizers[0].param_groups] == [6, 4, 2]
    assert [len(g["params"]) for g in port.optimizers["optimizer"].param_groups] == [16]
    assert max_diff(lit, port.model) > 0


def test_lightning_example_finetuning_frozen_before_the_trainer_matches():
    """The same, the backbone frozen before the Trainer is made: three epochs (milestones 1 and 2, MultiStepLR at
    each), BatchNorm frozen with its running statistics off, bit for bit."""
    lit, port = transfer_runs(freeze_first=True)
    assert [g["lr"] for g in port.optimizers["optimizer"].param_groups] == [
        g["lr"] for g in lit.trainer.optimizers[0].param_groups]
    assert_same(lit, port.model)
