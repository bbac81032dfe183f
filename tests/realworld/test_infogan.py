"""InfoGAN, whose third optimizer holds both networks' parameters: eriklindernoren/PyTorch-GAN at commit
36d3c77e5ff20ebe0aeefd322326a134a279b93e, implementations/infogan/infogan.py.

Three Adam optimizers: ``optimizer_G`` over the generator, ``optimizer_D`` over the discriminator and
``optimizer_info`` over ``itertools.chain(generator.parameters(), discriminator.parameters())``: the same
parameters held by two optimizers, each with its own moments. Every batch steps all three in turn: the
generator's adversarial loss through the discriminator (leaving gradients on the discriminator, which
``optimizer_D.zero_grad()`` clears), the discriminator on real images and detached fakes, then the mutual
information loss (a cross-entropy on a sampled categorical code and an MSE on a continuous one) on a fresh
generation, back-propagated into both networks and stepped by ``optimizer_info`` after the other two have
moved them. Latents, labels and codes come from NumPy's global RNG; BatchNorm (``BatchNorm2d(n, 0.8)``: 0.8 is
its eps), ``Dropout2d`` and in-place LeakyReLUs in the discriminator; ``nn.Softmax()`` without a dim.

Changes for a seconds-long test: 16x16 images (32x32), 8 channels throughout (the source's 128 and 64 in the
generator, 16 to 128 in the discriminator), a latent of 4 (62), 3 classes (10), 4 batches of 8 random
images in place of MNIST; no CUDA (``FloatTensor`` is ``torch.FloatTensor``); the progress print and the
sample images are left out.

The port is manual (a ``ConfigError`` in automatic mode, where two optimizers may not share parameters):
``self.backward``/``self.step`` for "G", "D" and "info" in the source's order.
"""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.autograd import Variable

from safeloop import Trainer

from .harness import checks, compare

opt = SimpleNamespace(n_epochs=1, batch_size=8, lr=0.0002, b1=0.5, b2=0.999, latent_dim=4, code_dim=2, n_classes=3,
                      img_size=16, channels=1)
WIDTH, STEPS = 8, 4
FloatTensor = torch.FloatTensor
LongTensor = torch.LongTensor


def weights_init_normal(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight.data, 1.0, 0.02)
        torch.nn.init.constant_(m.bias.data, 0.0)


def to_categorical(y, num_columns):
    """Returns one-hot encoded Variable"""
    y_cat = np.zeros((y.shape[0], num_columns))
    y_cat[range(y.shape[0]), y] = 1.0

    return Variable(FloatTensor(y_cat))


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()
        input_dim = opt.latent_dim + opt.n_classes + opt.code_dim

        self.init_size = opt.img_size // 4  # Initial size before upsampling
        self.l1 = nn.Sequential(nn.Linear(input_dim, WIDTH * self.init_size ** 2))

        self.conv_blocks = nn.Sequential(
            nn.BatchNorm2d(WIDTH),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(WIDTH, WIDTH, 3, stride=1, padding=1),
            nn.BatchNorm2d(WIDTH, 0.8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(WIDTH, WIDTH, 3, stride=1, padding=1),
            nn.BatchNorm2d(WIDTH, 0.8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(WIDTH, opt.channels, 3, stride=1, padding=1),
            nn.Tanh(),
        )

    def forward(self, noise, labels, code):
        gen_input = torch.cat((noise, labels, code), -1)
        out = self.l1(gen_input)
        out = out.view(out.shape[0], WIDTH, self.init_size, self.init_size)
        img = self.conv_blocks(out)
        return img


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()

        def discriminator_block(in_filters, out_filters, bn=True):
            """Returns layers of each discriminator block"""
            block = [nn.Conv2d(in_filters, out_filters, 3, 2, 1), nn.LeakyReLU(0.2, inplace=True), nn.Dropout2d(0.25)]
            if bn:
                block.append(nn.BatchNorm2d(out_filters, 0.8))
            return block

        self.conv_blocks = nn.Sequential(
            *discriminator_block(opt.channels, WIDTH, bn=False),
            *discriminator_block(WIDTH, WIDTH),
            *discriminator_block(WIDTH, WIDTH),
            *discriminator_block(WIDTH, WIDTH),
        )

        # The height and width of downsampled image
        ds_size = opt.img_size // 2 ** 4

        # Output layers
        self.adv_layer = nn.Sequential(nn.Linear(WIDTH * ds_size ** 2, 1))
        self.aux_layer = nn.Sequential(nn.Linear(WIDTH * ds_size ** 2, opt.n_classes), nn.Softmax())
        self.latent_layer = nn.Sequential(nn.Linear(WIDTH * ds_size ** 2, opt.code_dim))

    def forward(self, img):
        out = self.conv_blocks(img)
        out = out.view(out.shape[0], -1)
        validity = self.adv_layer(out)
        label = self.aux_layer(out)
        latent_code = self.latent_layer(out)

        return validity, label, latent_code


# Loss functions
adversarial_loss = torch.nn.MSELoss()
categorical_loss = torch.nn.CrossEntropyLoss()
continuous_loss = torch.nn.MSELoss()

# Loss weights
lambda_cat = 1
lambda_con = 0.1


def gan():
    model = nn.Module()
    model.generator, model.discriminator = Generator(), Discriminator()
    # Initialize weights
    model.generator.apply(weights_init_normal)
    model.discriminator.apply(weights_init_normal)
    return model


def optimizers(generator, discriminator):
    optimizer_G = torch.optim.Adam(generator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
    optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
    optimizer_info = torch.optim.Adam(
        itertools.chain(generator.parameters(), discriminator.parameters()), lr=opt.lr, betas=(opt.b1, opt.b2)
    )
    return optimizer_G, optimizer_D, optimizer_info


def infogan_step(generator, discriminator, imgs, labels, backward, step):
    """The loop's body; ``backward(loss, name)`` and ``step(name)``: the source's calls or the Trainer's."""
    batch_size = imgs.shape[0]

    # Adversarial ground truths
    valid = Variable(FloatTensor(batch_size, 1).fill_(1.0), requires_grad=False)
    fake = Variable(FloatTensor(batch_size, 1).fill_(0.0), requires_grad=False)

    # Configure input
    real_imgs = Variable(imgs.type(FloatTensor))
    labels = to_categorical(labels.numpy(), num_columns=opt.n_classes)

    # -----------------
    #  Train Generator
    # -----------------

    # Sample noise and labels as generator input
    z = Variable(FloatTensor(np.random.normal(0, 1, (batch_size, opt.latent_dim))))
    label_input = to_categorical(np.random.randint(0, opt.n_classes, batch_size), num_columns=opt.n_classes)
    code_input = Variable(FloatTensor(np.random.uniform(-1, 1, (batch_size, opt.code_dim))))

    # Generate a batch of images
    gen_imgs = generator(z, label_input, code_input)

    # Loss measures generator's ability to fool the discriminator
    validity, _, _ = discriminator(gen_imgs)
    g_loss = adversarial_loss(validity, valid)

    backward(g_loss, "G")
    step("G")

    # ---------------------
    #  Train Discriminator
    # ---------------------

    # Loss for real images
    real_pred, _, _ = discriminator(real_imgs)
    d_real_loss = adversarial_loss(real_pred, valid)

    # Loss for fake images
    fake_pred, _, _ = discriminator(gen_imgs.detach())
    d_fake_loss = adversarial_loss(fake_pred, fake)

    # Total discriminator loss
    d_loss = (d_real_loss + d_fake_loss) / 2

    backward(d_loss, "D")
    step("D")

    # ------------------
    # Information Loss
    # ------------------

    # Sample labels
    sampled_labels = np.random.randint(0, opt.n_classes, batch_size)

    # Ground truth labels
    gt_labels = Variable(LongTensor(sampled_labels), requires_grad=False)

    # Sample noise, labels and code as generator input
    z = Variable(FloatTensor(np.random.normal(0, 1, (batch_size, opt.latent_dim))))
    label_input = to_categorical(sampled_labels, num_columns=opt.n_classes)
    code_input = Variable(FloatTensor(np.random.uniform(-1, 1, (batch_size, opt.code_dim))))

    gen_imgs = generator(z, label_input, code_input)
    _, pred_label, pred_code = discriminator(gen_imgs)

    info_loss = lambda_cat * categorical_loss(pred_label, gt_labels) + lambda_con * continuous_loss(
        pred_code, code_input
    )

    backward(info_loss, "info")
    step("info")
    return {"G": g_loss, "D": d_loss, "info": info_loss}


def infogan_hand(model, dataloader):
    generator, discriminator = model.generator, model.discriminator
    optimizer_G, optimizer_D, optimizer_info = optimizers(generator, discriminator)
    named = {"G": optimizer_G, "D": optimizer_D, "info": optimizer_info}

    def backward(loss, name):
        named[name].zero_grad()  # optimizer_G.zero_grad() etc., each before its phase's forward in the source
        loss.backward()

    for epoch in range(opt.n_epochs):
        for i, (imgs, labels) in enumerate(dataloader):
            infogan_step(generator, discriminator, imgs, labels, backward, lambda name: named[name].step())


class InfoGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        return dict(zip(("G", "D", "info"), optimizers(self.model.generator, self.model.discriminator)))

    def training_step(self, batch):
        imgs, labels = batch
        return infogan_step(self.model.generator, self.model.discriminator, imgs, labels,
                            lambda loss, name: self.backward(loss, optimizer=name), self.step)


def mnist(model):
    """Batches of images and labels; NumPy's global RNG (latents, labels, codes) seeded before each run."""
    np.random.seed(0)
    gen = torch.Generator().manual_seed(20)
    return [(torch.rand(opt.batch_size, opt.channels, opt.img_size, opt.img_size, generator=gen) * 2 - 1,
             torch.randint(opt.n_classes, (opt.batch_size,), generator=gen)) for _ in range(STEPS)]


@pytest.mark.parametrize("check", checks())
def test_infogan_with_an_optimizer_over_both_networks(check):
    compare(gan, infogan_hand, InfoGAN, mnist, check, steps=STEPS)
