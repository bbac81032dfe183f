"""VAE-GAN with three optimizers stepping between backwards through one retained graph:
lucabergamini/VAEGAN-PYTORCH at commit fa75275d743ef27075aaf198cf4abff5ffbba540, main.py (the loop) and
network.py (``EncoderBlock``, ``DecoderBlock``, ``Encoder``, ``Decoder``, ``Discriminator``, ``VaeGan``).

One forward per batch builds everything: the encoder's ``mu``/``logvar``, a reparameterized sample decoded
and compared with the real images at a hidden layer of the discriminator (``recon_level``, the layer's
pre-BatchNorm output), and a second decoding, of noise made a leaf that *requires grad*
(``Variable(torch.randn(...), requires_grad=True)``), classified by the discriminator next to the real
images. Then ``net.zero_grad()``, ``loss_encoder.backward(retain_graph=True)``, the encoder's RMSprop
step; ``net.zero_grad()``, ``loss_decoder.backward(retain_graph=True)`` (the feature-matching term reaches
back through the encoder), the decoder's step; ``net.discriminator.zero_grad()``,
``loss_discriminator.backward()`` (through the decoder, to the noise leaf), the discriminator's step; which
of the last two run is decided by an equilibrium margin on the discriminator's losses. BatchNorm with
``momentum=0.9`` everywhere, in-place ReLUs, ``ExponentialLR`` per epoch.

Since PyTorch 1.5 an optimizer's in-place step is an error for a later backward through tensors it saved:
this loop fails at its second backward (the encoder's ``l_mu``/``l_var`` weights, which ``loss_decoder``'s
graph saved, were changed by ``optimizer_encoder.step()``). The first test checks that
the hand loop raises PyTorch's ``RuntimeError`` and that ``watch`` names the update between the loss and its
backward (the encoder's RMSprop). The port routes each backward to its optimizer's parameters
(``backward(inputs=...)``), which never goes back through the encoder from ``loss_decoder``, nor through the
decoder from ``loss_discriminator``: it trains, bit for bit as the loop does with ``inputs=`` on those two
backwards (what PyTorch before 1.5 wrote into the parameters each optimizer steps); the second test.

Changes for a seconds-long test: 8x8 images of 4 (64x64 CelebA of 64), channels 4-8-16 (64-128-256) in
the encoder, 4-8-8 in the discriminator (32-128-256-256), fc widths 16 (1024, 512), ``z_size`` 4 (128);
``.data.cpu().numpy()[0]`` / ``.data[0]`` on 0-d tensors as ``.item()``; ``nn.init.uniform``/``constant`` as
their in-place forms; no CUDA, no progress bar or TensorBoard, no test-set images; 2 epochs of 3 batches.

The port is manual, over ``encoder``, ``decoder`` and ``discriminator`` optimizers with their schedulers
(``interval: epoch``).
"""
import numpy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Variable
from torch.optim import RMSprop
from torch.optim.lr_scheduler import ExponentialLR

from safeloop import GraphGuard, InplaceModificationError, Trainer
from safeloop.watch import Watch

from .harness import CHECKS, checks, compare

Z_SIZE, RECON_LEVEL, SIDE, BATCH, FC, EPOCHS, PER_EPOCH = 4, 3, 1, 4, 16, 2, 3


class EncoderBlock(nn.Module):
    def __init__(self, channel_in, channel_out):
        super(EncoderBlock, self).__init__()
        self.conv = nn.Conv2d(in_channels=channel_in, out_channels=channel_out, kernel_size=5, padding=2, stride=2,
                              bias=False)
        self.bn = nn.BatchNorm2d(num_features=channel_out, momentum=0.9)

    def forward(self, ten, out=False,t = False):
        if out:
            ten = self.conv(ten)
            ten_out = ten
            ten = self.bn(ten)
            ten = F.relu(ten, False)
            return ten, ten_out
        else:
            ten = self.conv(ten)
            ten = self.bn(ten)
            ten = F.relu(ten, True)
            return ten


class DecoderBlock(nn.Module):
    def __init__(self, channel_in, channel_out):
        super(DecoderBlock, self).__init__()
        self.conv = nn.ConvTranspose2d(channel_in, channel_out, kernel_size=5, padding=2, stride=2, output_padding=1,
                                       bias=False)
        self.bn = nn.BatchNorm2d(channel_out, momentum=0.9)

    def forward(self, ten):
        ten = self.conv(ten)
        ten = self.bn(ten)
        ten = F.relu(ten, True)
        return ten


class Encoder(nn.Module):
    def __init__(self, channel_in=3, z_size=128):
        super(Encoder, self).__init__()
        self.size = channel_in
        layers_list = []
        for i in range(3):
            if i == 0:
                layers_list.append(EncoderBlock(channel_in=self.size, channel_out=4))
                self.size = 4
            else:
                layers_list.append(EncoderBlock(channel_in=self.size, channel_out=self.size * 2))
                self.size *= 2
        self.conv = nn.Sequential(*layers_list)
        self.fc = nn.Sequential(nn.Linear(in_features=SIDE * SIDE * self.size, out_features=FC, bias=False),
                                nn.BatchNorm1d(num_features=FC,momentum=0.9),
                                nn.ReLU(True))
        self.l_mu = nn.Linear(in_features=FC, out_features=z_size)
        self.l_var = nn.Linear(in_features=FC, out_features=z_size)

    def forward(self, ten):
        ten = self.conv(ten)
        ten = ten.view(len(ten), -1)
        ten = self.fc(ten)
        mu = self.l_mu(ten)
        logvar = self.l_var(ten)
        return mu, logvar


class Decoder(nn.Module):
    def __init__(self, z_size, size):
        super(Decoder, self).__init__()
        self.fc = nn.Sequential(nn.Linear(in_features=z_size, out_features=SIDE * SIDE * size, bias=False),
                                nn.BatchNorm1d(num_features=SIDE * SIDE * size,momentum=0.9),
                                nn.ReLU(True))
        self.size = size
        layers_list = []
        layers_list.append(DecoderBlock(channel_in=self.size, channel_out=self.size))
        layers_list.append(DecoderBlock(channel_in=self.size, channel_out=self.size//2))
        self.size = self.size//2
        layers_list.append(DecoderBlock(channel_in=self.size, channel_out=self.size//4))
        self.size = self.size//4
        layers_list.append(nn.Sequential(
            nn.Conv2d(in_channels=self.size, out_channels=3, kernel_size=5, stride=1, padding=2),
            nn.Tanh()
        ))
        self.conv = nn.Sequential(*layers_list)

    def forward(self, ten):
        ten = self.fc(ten)
        ten = ten.view(len(ten), -1, SIDE, SIDE)
        ten = self.conv(ten)
        return ten


class Discriminator(nn.Module):
    def __init__(self, channel_in=3,recon_level=3):
        super(Discriminator, self).__init__()
        self.size = channel_in
        self.recon_levl = recon_level
        self.conv = nn.ModuleList()
        self.conv.append(nn.Sequential(
            nn.Conv2d(in_channels=3, out_channels=4, kernel_size=5, stride=1, padding=2),
            nn.ReLU(inplace=True)))
        self.size = 4
        self.conv.append(EncoderBlock(channel_in=self.size, channel_out=8))
        self.size = 8
        self.conv.append(EncoderBlock(channel_in=self.size, channel_out=8))
        self.size = 8
        self.conv.append(EncoderBlock(channel_in=self.size, channel_out=8))
        self.fc = nn.Sequential(
            nn.Linear(in_features=SIDE * SIDE * self.size, out_features=FC, bias=False),
            nn.BatchNorm1d(num_features=FC,momentum=0.9),
            nn.ReLU(inplace=True),
            nn.Linear(in_features=FC, out_features=1),
        )

    def forward(self, ten,other_ten,mode='REC'):
        if mode == "REC":
            ten = torch.cat((ten, other_ten), 0)
            for i, lay in enumerate(self.conv):
                if i == self.recon_levl:
                    ten, layer_ten = lay(ten, True)
                    layer_ten = layer_ten.view(len(layer_ten), -1)
                    return layer_ten
                else:
                    ten = lay(ten)
        else:
            ten = torch.cat((ten, other_ten), 0)
            for i, lay in enumerate(self.conv):
                    ten = lay(ten)
            ten = ten.view(len(ten), -1)
            ten = self.fc(ten)
            return F.sigmoid(ten)


class VaeGan(nn.Module):
    def __init__(self,z_size=128,recon_level=3):
        super(VaeGan, self).__init__()
        self.z_size = z_size
        self.encoder = Encoder(z_size=self.z_size)
        self.decoder = Decoder(z_size=self.z_size, size=self.encoder.size)
        self.discriminator = Discriminator(channel_in=3,recon_level=recon_level)
        self.init_parameters()

    def init_parameters(self):
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
                if hasattr(m, "weight") and m.weight is not None and m.weight.requires_grad:
                    scale = 1.0/numpy.sqrt(numpy.prod(m.weight.shape[1:]))
                    scale /=numpy.sqrt(3)
                    nn.init.uniform_(m.weight,-scale,scale)
                if hasattr(m, "bias") and m.bias is not None and m.bias.requires_grad:
                    nn.init.constant_(m.bias, 0.0)

    def forward(self, ten, gen_size=10):
        if self.training:
            ten_original = ten
            mus, log_variances = self.encoder(ten)
            variances = torch.exp(log_variances * 0.5)
            ten_from_normal = Variable(torch.randn(len(ten), self.z_size), requires_grad=True)
            ten = ten_from_normal * variances + mus
            ten = self.decoder(ten)
            ten_layer = self.discriminator(ten, ten_original, "REC")
            ten_from_normal = Variable(torch.randn(len(ten), self.z_size), requires_grad=True)
            ten = self.decoder(ten_from_normal)
            ten_class = self.discriminator(ten_original, ten, "GAN")
            return ten, ten_class, ten_layer, mus, log_variances

    @staticmethod
    def loss(ten_original, ten_predict, layer_original, layer_predicted, labels_original,
             labels_sampled, mus, variances):
        nle = 0.5*(ten_original.view(len(ten_original), -1) - ten_predict.view(len(ten_predict), -1)) ** 2
        kl = -0.5 * torch.sum(-variances.exp() - torch.pow(mus,2) + variances + 1, 1)
        mse = torch.sum(0.5*(layer_original - layer_predicted) ** 2, 1)
        bce_dis_original = -torch.log(labels_original + 1e-3)
        bce_dis_sampled = -torch.log(1 - labels_sampled + 1e-3)
        bce_gen_original = -torch.log(1-labels_original + 1e-3)
        bce_gen_sampled = -torch.log(labels_sampled + 1e-3)
        return nle, kl, mse, bce_dis_original, bce_dis_sampled,bce_gen_original,bce_gen_sampled


def make_model():
    return VaeGan(z_size=Z_SIZE, recon_level=RECON_LEVEL)


def make_optimizers(net, lr=3e-4, decay_lr=0.75):
    optimizer_encoder = RMSprop(params=net.encoder.parameters(),lr=lr,alpha=0.9,eps=1e-8,weight_decay=0,
                              momentum=0,centered=False)
    lr_encoder = ExponentialLR(optimizer_encoder, gamma=decay_lr)
    optimizer_decoder = RMSprop(params=net.decoder.parameters(),lr=lr,alpha=0.9,eps=1e-8,weight_decay=0,
                              momentum=0,centered=False)
    lr_decoder = ExponentialLR(optimizer_decoder, gamma=decay_lr)
    optimizer_discriminator = RMSprop(params=net.discriminator.parameters(),lr=lr,alpha=0.9,eps=1e-8,weight_decay=0,
                              momentum=0,centered=False)
    lr_discriminator = ExponentialLR(optimizer_discriminator, gamma=decay_lr)
    return (optimizer_encoder, optimizer_decoder, optimizer_discriminator), (lr_encoder, lr_decoder, lr_discriminator)


def losses(net, data_batch, target_batch, lambda_mse, equilibrium, margin):
    data_target = Variable(target_batch, requires_grad=False).float()
    data_in = Variable(data_batch, requires_grad=False).float()
    out, out_labels, out_layer, mus, variances = net(data_in)
    out_layer_predicted = out_layer[:len(out_layer) // 2]
    out_layer_original = out_layer[len(out_layer) // 2:]
    out_labels_original = out_labels[:len(out_labels) // 2]
    out_labels_sampled = out_labels[-len(out_labels) // 2:]
    nle_value, kl_value, mse_value, bce_dis_original_value, bce_dis_sampled_value,\
        bce_gen_original_value,bce_gen_sampled_value= VaeGan.loss(data_target, out, out_layer_original,
                                                                 out_layer_predicted, out_labels_original,
                                                                  out_labels_sampled, mus,
                                                                 variances)
    loss_encoder = torch.sum(kl_value)+torch.sum(mse_value)
    loss_discriminator = torch.sum(bce_dis_original_value) + torch.sum(bce_dis_sampled_value)
    loss_decoder = torch.sum(lambda_mse * mse_value) - (1.0 - lambda_mse) * loss_discriminator
    train_dis = True
    train_dec = True
    if (torch.mean(bce_dis_original_value).item() < equilibrium-margin
            or torch.mean(bce_dis_sampled_value).item() < equilibrium-margin):
        train_dis = False
    if (torch.mean(bce_dis_original_value).item() > equilibrium+margin
            or torch.mean(bce_dis_sampled_value).item() > equilibrium+margin):
        train_dec = False
    if train_dec is False and train_dis is False:
        train_dis = True
        train_dec = True
    return loss_encoder, loss_decoder, loss_discriminator, train_dec, train_dis


def vaegan_hand(net, dataloader, n_epochs=EPOCHS, lambda_mse=1e-6, margin=0.35, equilibrium=0.68):
    (optimizer_encoder, optimizer_decoder, optimizer_discriminator), schedulers = make_optimizers(net)
    for i in range(n_epochs):
        for j, (data_batch,target_batch) in enumerate(dataloader):
            net.train()
            loss_encoder, loss_decoder, loss_discriminator, train_dec, train_dis = losses(
                net, data_batch, target_batch, lambda_mse, equilibrium, margin)
            net.zero_grad()
            loss_encoder.backward(retain_graph=True)
            optimizer_encoder.step()
            net.zero_grad()
            if train_dec:
                loss_decoder.backward(retain_graph=True)
                optimizer_decoder.step()
                net.discriminator.zero_grad()
            if train_dis:
                loss_discriminator.backward()
                optimizer_discriminator.step()
        for scheduler in schedulers:
            scheduler.step()


def vaegan_hand_routed(net, dataloader, n_epochs=EPOCHS, lambda_mse=1e-6, margin=0.35, equilibrium=0.68):
    """The loop with the two later backwards given ``inputs=`` (their optimizer's parameters): they no longer
    go back through the part the previous step changed, and write what PyTorch before 1.5 wrote there."""
    (optimizer_encoder, optimizer_decoder, optimizer_discriminator), schedulers = make_optimizers(net)
    for i in range(n_epochs):
        for j, (data_batch,target_batch) in enumerate(dataloader):
            net.train()
            loss_encoder, loss_decoder, loss_discriminator, train_dec, train_dis = losses(
                net, data_batch, target_batch, lambda_mse, equilibrium, margin)
            net.zero_grad()
            loss_encoder.backward(retain_graph=True)
            optimizer_encoder.step()
            net.zero_grad()
            if train_dec:
                loss_decoder.backward(retain_graph=True, inputs=list(net.decoder.parameters()))
                optimizer_decoder.step()
                net.discriminator.zero_grad()
            if train_dis:
                loss_discriminator.backward(inputs=list(net.discriminator.parameters()))
                optimizer_discriminator.step()
        for scheduler in schedulers:
            scheduler.step()


class VaeGanTrainer(Trainer):
    automatic = False

    def configure_optimizers(self):
        optimizers, schedulers = make_optimizers(self.model)
        return {name: {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
                for name, optimizer, scheduler in zip(("encoder", "decoder", "discriminator"), optimizers, schedulers)}

    def training_step(self, batch):
        self.model.train()
        loss_encoder, loss_decoder, loss_discriminator, train_dec, train_dis = losses(
            self.model, *batch, 1e-6, 0.68, 0.35)
        self.backward(loss_encoder, optimizer="encoder", retain_graph=True)
        self.step("encoder")
        if train_dec:
            self.backward(loss_decoder, optimizer="decoder", retain_graph=True)
            self.step("decoder")
        if train_dis:
            self.backward(loss_discriminator, optimizer="discriminator")
            self.step("discriminator")
        return {"encoder": loss_encoder}


def celeba():
    gen = torch.Generator().manual_seed(9)
    return [(x, x) for x in (torch.rand(BATCH, 3, 8, 8, generator=gen) * 2 - 1 for _ in range(PER_EPOCH))]


@pytest.mark.parametrize("check", CHECKS)
def test_vaegan_as_written_fails_and_watch_names_the_encoder_step(check):
    torch.manual_seed(0)
    net = make_model()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        vaegan_hand(net, celeba())
    torch.manual_seed(0)
    net = make_model()
    with Watch(GraphGuard(check=check), vaegan_hand.__code__.co_filename):
        with pytest.raises(InplaceModificationError, match=r"optimizer 'optimizer_encoder' stepped after this loss "
                                                           r"was built"):
            vaegan_hand(net, celeba())


@pytest.mark.parametrize("check", checks())
def test_vaegan_with_its_later_backwards_routed(check):
    """The port's ``self.backward(loss, optimizer=...)`` is ``backward(inputs=...)``: it trains as the loop does
    with ``inputs=`` on its later two backwards."""
    compare(make_model, vaegan_hand_routed, VaeGanTrainer, lambda net: celeba(), check, steps=EPOCHS * PER_EPOCH,
            max_epochs=EPOCHS)
