"""A Fourier neural operator with complex parameters: scaomath/fourier_neural_operator at commit
40cdf1c900311a21cd571e5ca55278c4092fad7d (a fork of zongyi-li/fourier_neural_operator), fourier_1d.py
(``SpectralConv1d``, ``FNO1d``, the loop) and utilities3.py (``LpLoss``).

Each spectral layer's weights are an ``nn.Parameter`` of dtype ``torch.cfloat``: the forward takes
``torch.fft.rfft`` of its input, multiplies the lowest modes by the weights with ``einsum``, writes them into a new
complex zeros tensor by slice assignment, and goes back with ``irfft``. Adam (with weight decay) updates the
complex parameters; the loss is the summed relative L2 error; a ``OneCycleLR`` steps after every update; each epoch
ends with an evaluation under ``no_grad``.

Changes for a seconds-long test: 8 grid points (8192 / 4), 2 modes (16), width 3 (64), batches of 4, 2 epochs of
2 batches (100 of 256), a ``OneCycleLR`` over those; lists of seeded batches for the shuffled ``DataLoader``s and
``.cpu()`` for ``.cuda()``; no printing or timing.

The port returns the relative L2 loss, steps the scheduler per update and evaluates in ``on_epoch_end``; with
``on_nonfinite="error"`` too (the finite check reads a complex gradient as its real and imaginary parts).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare

ntrain, s, batch_size, learning_rate, epochs, modes, width = 8, 8, 4, 0.001, 2, 2, 3


# -- fourier_1d.py ------------------------------------------------------------------------------------------
class SpectralConv1d(nn.Module):
    def __init__(self, in_channels, out_channels, modes1):
        super(SpectralConv1d, self).__init__()

        """
        1D Fourier layer. It does FFT, linear transform, and Inverse FFT.
        """

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.modes1 = modes1  #Number of Fourier modes to multiply, at most floor(N/2) + 1

        self.scale = (1 / (in_channels*out_channels))
        self.weights1 = nn.Parameter(self.scale * torch.rand(in_channels, out_channels, self.modes1,
                                                             dtype=torch.cfloat))

    # Complex multiplication
    def compl_mul1d(self, input, weights):
        # (batch, in_channel, x ), (in_channel, out_channel, x) -> (batch, out_channel, x)
        return torch.einsum("bix,iox->box", input, weights)

    def forward(self, x):
        batchsize = x.shape[0]
        #Compute Fourier coeffcients up to factor of e^(- something constant)
        x_ft = torch.fft.rfft(x)

        # Multiply relevant Fourier modes
        out_ft = torch.zeros(batchsize, self.out_channels, x.size(-1)//2 + 1,  device=x.device, dtype=torch.cfloat)
        out_ft[:, :, :self.modes1] = self.compl_mul1d(x_ft[:, :, :self.modes1], self.weights1)

        #Return to physical space
        x = torch.fft.irfft(out_ft, n=x.size(-1))
        return x


class FNO1d(nn.Module):
    def __init__(self, modes, width):
        super(FNO1d, self).__init__()
        self.modes1 = modes
        self.width = width
        self.fc0 = nn.Linear(2, self.width) # input channel is 2: (a(x), x)

        self.conv0 = SpectralConv1d(self.width, self.width, self.modes1)
        self.conv1 = SpectralConv1d(self.width, self.width, self.modes1)
        self.conv2 = SpectralConv1d(self.width, self.width, self.modes1)
        self.conv3 = SpectralConv1d(self.width, self.width, self.modes1)
        self.w0 = nn.Conv1d(self.width, self.width, 1)
        self.w1 = nn.Conv1d(self.width, self.width, 1)
        self.w2 = nn.Conv1d(self.width, self.width, 1)
        self.w3 = nn.Conv1d(self.width, self.width, 1)


        self.fc1 = nn.Linear(self.width, 128)
        self.fc2 = nn.Linear(128, 1)

    def forward(self, x):

        x = self.fc0(x)
        x = x.permute(0, 2, 1)

        x1 = self.conv0(x)
        x2 = self.w0(x)
        x = x1 + x2
        x = F.relu(x)

        x1 = self.conv1(x)
        x2 = self.w1(x)
        x = x1 + x2
        x = F.relu(x)

        x1 = self.conv2(x)
        x2 = self.w2(x)
        x = x1 + x2
        x = F.relu(x)

        x1 = self.conv3(x)
        x2 = self.w3(x)
        x = x1 + x2

        x = x.permute(0, 2, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.fc2(x)
        return x


# -- utilities3.py ------------------------------------------------------------------------------------------
class LpLoss(object):
    def __init__(self, d=2, p=2, size_average=True, reduction=True):
        super(LpLoss, self).__init__()

        #Dimension and Lp-norm type are postive
        assert d > 0 and p > 0

        self.d = d
        self.p = p
        self.reduction = reduction
        self.size_average = size_average

    def rel(self, x, y):
        num_examples = x.size()[0]

        diff_norms = torch.norm(x.reshape(num_examples,-1) - y.reshape(num_examples,-1), self.p, 1)
        y_norms = torch.norm(y.reshape(num_examples,-1), self.p, 1)

        if self.reduction:
            if self.size_average:
                return torch.mean(diff_norms/y_norms)
            else:
                return torch.sum(diff_norms/y_norms)

        return diff_norms/y_norms

    def __call__(self, x, y):
        return self.rel(x, y)


# -- the loop -----------------------------------------------------------------------------------------------
def burgers(model=None):
    gen = torch.Generator().manual_seed(6)
    grid = torch.linspace(0, 1, s).reshape(1, s, 1)
    out = []
    for _ in range(ntrain // batch_size):
        a, u = torch.randn(batch_size, s, generator=gen), torch.randn(batch_size, s, generator=gen)
        out.append((torch.cat([a.reshape(batch_size, s, 1), grid.repeat(batch_size, 1, 1)], dim=2), u))
    return out


def make_optimizer_and_scheduler(model):
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate,
                            div_factor=1e4, final_div_factor=1e4,
                            steps_per_epoch=ntrain // batch_size, epochs=epochs)
    return optimizer, scheduler


def evaluate(model, test_loader, myloss):
    model.eval()
    test_l2 = 0.0
    with torch.no_grad():
        for x, y in test_loader:
            out = model(x)
            test_l2 += myloss(out.view(batch_size, -1), y.view(batch_size, -1)).item()
    return test_l2


def fno_hand(model, train_loader):
    optimizer, scheduler = make_optimizer_and_scheduler(model)
    myloss = LpLoss(size_average=False)
    for ep in range(epochs):
        model.train()
        train_mse = 0
        train_l2 = 0
        for x, y in train_loader:
            x, y = x.cpu(), y.cpu()

            optimizer.zero_grad()
            out = model(x)

            mse = F.mse_loss(out.view(batch_size, -1), y.view(batch_size, -1), reduction='mean')
            l2 = myloss(out.view(batch_size, -1), y.view(batch_size, -1))
            l2.backward() # use the l2 relative loss

            optimizer.step()
            train_mse += mse.item()
            train_l2 += l2.item()
            scheduler.step()

        evaluate(model, burgers(), myloss)


class FNOTrainer(Trainer):
    def configure_optimizers(self):
        self.myloss = LpLoss(size_average=False)
        optimizer, scheduler = make_optimizer_and_scheduler(self.model)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.log("mse", F.mse_loss(out.view(batch_size, -1), y.view(batch_size, -1), reduction='mean'))
        return self.myloss(out.view(batch_size, -1), y.view(batch_size, -1))

    def on_epoch_end(self):
        self.log("test_l2", evaluate(self.model, burgers(), self.myloss))
        self.model.train()


@pytest.mark.parametrize("check", checks())
def test_fno_with_complex_spectral_weights(check):
    compare(lambda: FNO1d(modes, width), fno_hand, FNOTrainer, burgers, check, steps=epochs * ntrain // batch_size)


def test_fno_with_a_non_finite_policy():
    compare(lambda: FNO1d(modes, width), fno_hand, FNOTrainer, burgers, "auto", steps=epochs * ntrain // batch_size,
            on_nonfinite="error")
