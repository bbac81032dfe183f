"""SN-GAN with ``n_dis`` discriminator steps per generator step: w86763777/pytorch-gan-collections at commit
860e90bd882eb5737103de55bcf0e977d6952343, sngan.py (``train``), source/models/sngan.py (``Generator``,
``Discriminator``), source/losses.py (``Hinge``) and source/utils.py (``generate_imgs``, ``infiniteloop``).

Every training step runs ``n_dis`` discriminator updates, each on fakes made under ``no_grad`` (the generator's
BatchNorm in train mode: its statistics move) and the next real batch of an endless loader, then one generator
update whose hinge loss goes through the discriminator (leaving gradients on it that its next ``zero_grad``
clears); every weight of the discriminator has ``torch.nn.utils.spectral_norm`` (a forward pre-hook whose power
iteration writes ``u``/``v`` buffers in place under ``no_grad`` at every forward in train mode, the generator's
step included). Two ``LambdaLR`` decays, both stepped after the generator's update. At step 1 and every
``sample_step`` the generator draws samples from a fixed ``sample_z`` with grad enabled and in train mode (its
BatchNorm statistics move again); at step 1 and every ``eval_step``, ``generate_imgs`` runs it in eval mode under
``no_grad`` and puts it back in train mode. The discriminator's last loss is logged with a graph.

Changes for a seconds-long test: the ``cnn32`` networks at two layers each with 4-8 channels, for 3x4x4 images
(``M=2`` and ``M=4``), ``z_dim=8``, batches of 4, ``n_dis=3``, 4 steps, ``sample_step=2``, ``eval_step=3``,
``generate_imgs`` over 8 images; ``.to(device)``, tensorboard, tqdm, image files, checkpoint files and the
Inception/FID metrics left out (``writer.add_scalar``'s ``loss`` kept as a variable).

The port is manual: ``n_dis`` real batches per step, the generator's ``LambdaLR`` given with its optimizer
(stepped by the Trainer after its update), the discriminator's stepped in ``training_step`` after the
generator's update (a scheduler the Trainer held would step after each of the ``n_dis`` updates); samples and
evaluation in ``on_step_end``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.init as init
import torch.optim as optim
import pytest
from torch.nn.utils.spectral_norm import spectral_norm

from safeloop import Trainer

from .harness import checks, compare

TOTAL_STEPS, BATCH_SIZE, Z_DIM, N_DIS, LR_G, LR_D, BETAS = 4, 4, 8, 3, 2e-4, 2e-4, (0.0, 0.9)
SAMPLE_STEP, EVAL_STEP, SAMPLE_SIZE, NUM_IMAGES = 2, 3, 6, 8


# -- source/models/sngan.py (cnn32, narrowed) ---------------------------------------------------------------
class Generator(nn.Module):
    def __init__(self, z_dim, M=2):
        super().__init__()
        self.M = M
        self.linear = nn.Linear(z_dim, M * M * 8)
        self.main = nn.Sequential(
            nn.BatchNorm2d(8),
            nn.ReLU(True),
            nn.ConvTranspose2d(8, 4, kernel_size=4, stride=2, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(True),
            nn.Conv2d(4, 3, kernel_size=3, stride=1, padding=1),
            nn.Tanh())
        self.initialize()

    def initialize(self):
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
                init.normal_(m.weight, std=0.02)
                init.zeros_(m.bias)

    def forward(self, z, *args, **kwargs):
        x = self.linear(z)
        x = x.view(x.size(0), -1, self.M, self.M)
        x = self.main(x)
        return x


class Discriminator(nn.Module):
    def __init__(self, M=4):
        super().__init__()
        self.M = M

        self.main = nn.Sequential(
            # M
            nn.Conv2d(3, 4, kernel_size=3, stride=1, padding=1),
            nn.LeakyReLU(0.1, inplace=True),
            nn.Conv2d(4, 8, kernel_size=4, stride=2, padding=1),
            nn.LeakyReLU(0.1, inplace=True))

        self.linear = nn.Linear(M // 2 * M // 2 * 8, 1)
        self.initialize()

    def initialize(self):
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                init.normal_(m.weight, std=0.02)
                init.zeros_(m.bias)
                spectral_norm(m)

    def forward(self, x, *args, **kwargs):
        x = self.main(x)
        x = torch.flatten(x, start_dim=1)
        x = self.linear(x)
        return x


# -- source/losses.py, source/utils.py ----------------------------------------------------------------------
class Hinge(nn.Module):
    def forward(self, pred_real, pred_fake=None):
        if pred_fake is not None:
            loss_real = F.relu(1 - pred_real).mean()
            loss_fake = F.relu(1 + pred_fake).mean()
            return loss_real + loss_fake
        else:
            loss = -pred_real.mean()
            return loss


def generate_imgs(net_G, device, z_dim=128, size=5000, batch_size=128):
    net_G.eval()
    imgs = []
    with torch.no_grad():
        for start in range(0, size, batch_size):
            end = min(start + batch_size, size)
            z = torch.randn(end - start, z_dim).to(device)
            imgs.append(net_G(z).cpu())
    net_G.train()
    imgs = torch.cat(imgs, dim=0)
    imgs = (imgs + 1) / 2
    return imgs


def infiniteloop(dataloader):
    while True:
        for x, _ in iter(dataloader):
            yield x


# -- sngan.py ------------------------------------------------------------------------------------------------
def sngan_hand(model, dataloader):
    device = torch.device("cpu")
    net_G, net_D = model.net_G, model.net_D
    loss_fn = Hinge()

    optim_G = optim.Adam(net_G.parameters(), lr=LR_G, betas=BETAS)
    optim_D = optim.Adam(net_D.parameters(), lr=LR_D, betas=BETAS)
    sched_G = optim.lr_scheduler.LambdaLR(
        optim_G, lambda step: 1 - step / TOTAL_STEPS)
    sched_D = optim.lr_scheduler.LambdaLR(
        optim_D, lambda step: 1 - step / TOTAL_STEPS)

    sample_z = torch.randn(SAMPLE_SIZE, Z_DIM).to(device)

    looper = infiniteloop(dataloader)
    for step in range(1, TOTAL_STEPS + 1):
        # Discriminator
        for _ in range(N_DIS):
            with torch.no_grad():
                z = torch.randn(BATCH_SIZE, Z_DIM).to(device)
                fake = net_G(z).detach()
            real = next(looper).to(device)
            net_D_real = net_D(real)
            net_D_fake = net_D(fake)
            loss = loss_fn(net_D_real, net_D_fake)

            optim_D.zero_grad()
            loss.backward()
            optim_D.step()

        writer_loss = loss

        # Generator
        z = torch.randn(BATCH_SIZE * 2, Z_DIM).to(device)
        loss = loss_fn(net_D(net_G(z)))

        optim_G.zero_grad()
        loss.backward()
        optim_G.step()

        sched_G.step()
        sched_D.step()

        if step == 1 or step % SAMPLE_STEP == 0:
            fake = net_G(sample_z).cpu()
        if step == 1 or step % EVAL_STEP == 0:
            imgs = generate_imgs(net_G, device, Z_DIM, NUM_IMAGES, BATCH_SIZE)


def sngan():
    model = nn.Module()
    model.net_G, model.net_D = Generator(Z_DIM), Discriminator()
    return model


def images(model):
    gen = torch.Generator().manual_seed(2)
    return [(torch.rand(BATCH_SIZE, 3, 4, 4, generator=gen) * 2 - 1, torch.zeros(BATCH_SIZE)) for _ in range(5)]


class SNGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        optim_G = optim.Adam(self.model.net_G.parameters(), lr=LR_G, betas=BETAS)
        optim_D = optim.Adam(self.model.net_D.parameters(), lr=LR_D, betas=BETAS)
        sched_G = optim.lr_scheduler.LambdaLR(optim_G, lambda step: 1 - step / TOTAL_STEPS)
        self.sched_D = optim.lr_scheduler.LambdaLR(optim_D, lambda step: 1 - step / TOTAL_STEPS)
        return {"d": optim_D, "g": {"optimizer": optim_G, "lr_scheduler": {"scheduler": sched_G, "interval": "step"}}}

    def on_fit_start(self):
        self.loss_fn, self.sample_z = Hinge(), torch.randn(SAMPLE_SIZE, Z_DIM)

    def training_step(self, reals):
        net_G, net_D = self.model.net_G, self.model.net_D
        for real in reals:
            with torch.no_grad():
                fake = net_G(torch.randn(BATCH_SIZE, Z_DIM)).detach()
            d_loss = self.loss_fn(net_D(real), net_D(fake))
            self.backward(d_loss, optimizer="d")
            self.step("d")
        g_loss = self.loss_fn(net_D(net_G(torch.randn(BATCH_SIZE * 2, Z_DIM))))
        self.backward(g_loss, optimizer="g")
        self.step("g")
        self.sched_D.step()
        return {"d": d_loss, "g": g_loss}

    def on_step_end(self, losses):
        step = self.state.step
        if step == 1 or step % SAMPLE_STEP == 0:
            self.model.net_G(self.sample_z).cpu()
        if step == 1 or step % EVAL_STEP == 0:
            generate_imgs(self.model.net_G, self.device, Z_DIM, NUM_IMAGES, BATCH_SIZE)


def port(model, train_data, **kwargs):
    """The Trainer, given ``n_dis`` real batches a step from the same endless loader."""
    looper = infiniteloop(train_data)
    return SNGAN(model=model, train_data=[[next(looper) for _ in range(N_DIS)] for _ in range(TOTAL_STEPS)],
                 **kwargs)


@pytest.mark.parametrize("check", checks())
def test_sngan_with_n_dis_discriminator_steps_and_samples_drawn_with_grad(check):
    compare(sngan, sngan_hand, port, images, check, steps=TOTAL_STEPS)
