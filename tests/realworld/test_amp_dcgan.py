"""DCGAN's alternating updates under float16 autocast with one GradScaler: pytorch/examples at commit
13caa078cd69d74ffb447a9eda09f0a81b809480, dcgan/main.py (``Generator``, ``Discriminator``, ``weights_init`` and the
training loop), with AMP added as pytorch/pytorch's docs/source/notes/amp_examples.rst (commit
af616bb641d3825cc8216e583f2918912cc77103) says for several models, losses and optimizers: each forward and loss under
``autocast``, each loss back-propagated as ``scaler.scale(loss).backward()``, each optimizer stepped by
``scaler.step``, ``scaler.update()`` once per iteration after every optimizer has stepped.

D takes two backwards (real, then ``fake.detach()``) into one update; G's loss goes through D again (``netD(fake)``,
after D's update) and its ``backward()`` leaves gradient on D too, cleared by ``netD.zero_grad()`` at the next
iteration; ``label.fill_`` rewrites the target in place between the losses; BatchNorm in both nets and in-place
LeakyReLU in D; the noise drawn from torch's global generator inside the loop.

Changes for a seconds-long test: 8x8 single-channel images (64x64x3), ``nz`` 4, ``ngf`` = ``ndf`` = 4, two layers
in G and three in D (five each); 6 batches of 4 random images, one epoch; ``nn.BCEWithLogitsLoss`` with D's final
``nn.Sigmoid`` removed (``BCELoss`` is not safe under float16 autocast: the AMP docs name the logits form instead);
the CPU: ``torch.autocast("cpu", dtype=torch.float16)`` and ``torch.amp.GradScaler("cpu")``; no printing, image
saving or checkpointing. At GradScaler's initial scale (2**16) the first iteration's gradients overflow: a scaler
step is skipped and the scale halves.

The port: manual mode (``automatic = False``), ``precision="16-mixed"``, ``self.backward(loss, optimizer=...)`` and
``self.step(name)``; the Trainer updates the scaler once per step, as the docs' loop does.
"""
import pytest
import torch
import torch.nn as nn

from safeloop import Trainer

from .harness import checks, compare_runs

nz, ngf, ndf, nc = 4, 4, 4, 1
lr, beta1 = 0.0002, 0.5
real_label, fake_label = 1, 0
BATCHES = 6


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 4 x 4
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh()
            # state size. (nc) x 8 x 8
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            # input is (nc) x 8 x 8
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 4 x 4
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 2 x 2
            nn.Conv2d(ndf * 2, 1, 2, 1, 0, bias=False),
            # nn.Sigmoid(): the logits go to BCEWithLogitsLoss
        )

    def forward(self, input):
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


class DCGAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.netG, self.netD = Generator(), Discriminator()
        self.netG.apply(weights_init)
        self.netD.apply(weights_init)


criterion = nn.BCEWithLogitsLoss()  # nn.BCELoss()


class Images(list):
    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        super().__init__((torch.rand(4, nc, 8, 8, generator=gen) * 2 - 1,) for _ in range(BATCHES))
        self.scales = []


def dcgan_hand(gan, dataloader):
    netG, netD = gan.netG, gan.netD
    optimizerD = torch.optim.Adam(netD.parameters(), lr=lr, betas=(beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=lr, betas=(beta1, 0.999))
    scaler = torch.amp.GradScaler("cpu")
    autocast = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    for i, data in enumerate(dataloader, 0):
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        # train with real
        netD.zero_grad()
        real_cpu = data[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        with autocast():
            output = netD(real_cpu)
            errD_real = criterion(output, label)
        scaler.scale(errD_real).backward()
        # train with fake
        noise = torch.randn(batch_size, nz, 1, 1)
        with autocast():
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
        scaler.scale(errD_fake).backward()
        scaler.step(optimizerD)
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        with autocast():
            output = netD(fake)
            errG = criterion(output, label)
        scaler.scale(errG).backward()
        scaler.step(optimizerG)
        scaler.update()
        dataloader.scales.append(scaler.get_scale())


class DCGANTrainer(Trainer):
    automatic = False

    def configure_optimizers(self):
        return {"D": torch.optim.Adam(self.model.netD.parameters(), lr=lr, betas=(beta1, 0.999)),
                "G": torch.optim.Adam(self.model.netG.parameters(), lr=lr, betas=(beta1, 0.999))}

    def training_step(self, data):
        netG, netD = self.model.netG, self.model.netD
        real_cpu = data[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        self.backward(errD_real, optimizer="D")
        noise = torch.randn(batch_size, nz, 1, 1)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        self.backward(errD_fake, optimizer="D")
        self.step("D")
        label.fill_(real_label)
        output = netD(fake)
        errG = self.generator_loss(criterion(output, label))
        self.backward(errG, optimizer="G")
        self.step("G")
        return {"D": errD_real + errD_fake, "G": errG}

    def generator_loss(self, errG):
        return errG

    def on_step_end(self, losses):
        self.train_data.scales.append(self.scaler.get_scale())


@pytest.mark.parametrize("check", checks())
def test_dcgan_with_one_grad_scaler_for_both_optimizers(check):
    runs = compare_runs(DCGAN, dcgan_hand, DCGANTrainer, Images, check, steps=BATCHES, precision="16-mixed")
    hand, watched, port = (run.scales for run in runs)
    assert watched == hand and port == hand
    assert hand[0] == 2.0 ** 15, "the first iteration overflowed at GradScaler's initial scale: one was skipped"


class PoisonedGenerator(DCGANTrainer):
    """G's loss is NaN at step 3, after D's update of that step was made."""

    def generator_loss(self, errG):
        return errG * float("nan") if self.state.step + 1 == 3 else errG


def test_dcgan_step_skipped_for_a_nan_generator_loss_after_ds_update():
    torch.manual_seed(0)
    gan = DCGAN()
    trainer = PoisonedGenerator(model=gan, train_data=Images(), max_steps=BATCHES, device="cpu", progress=False,
                                loggers=(), precision="16-mixed", on_nonfinite="skip")
    trainer.fit()
    assert trainer.state.step == BATCHES and trainer.state.skipped == 1
    scales = trainer.train_data.scales
    assert scales[2] == scales[1]  # the skipped step left the scale as it was


def test_dcgan_with_one_grad_scaler_resumed_midway(tmp_path):
    from .harness import assert_same
    from .test_resume_ports import straight_and_resumed
    straight, resumed = straight_and_resumed(tmp_path, DCGAN, DCGANTrainer, lambda model: Images(), BATCHES, 2,
                                             precision="16-mixed")
    assert_same(resumed.model, straight.model)
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    assert resumed.train_data.scales == straight.train_data.scales[2:]
