"""Neural style transfer: pytorch/tutorials, advanced_source/neural_style_tutorial.py. What is trained
is the input image, through a frozen network into which loss modules are inserted that keep their
loss (and its graph) as ``self.loss``; L-BFGS steps with a closure that clamps the image in place
under ``no_grad`` before every evaluation. A tiny random conv stack stands in for VGG-19."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn, optim

from safeloop import Trainer

from .harness import checks, compare, fixed

STYLE_WEIGHT, CONTENT_WEIGHT = 1000000, 1  # run_style_transfer's defaults
CONTENT_LAYERS, STYLE_LAYERS = ["conv_2"], ["conv_1", "conv_2", "conv_3"]  # VGG's conv_4 and conv_1..5, scaled down
# The tutorial loops while run[0], its count of evaluations, is <= num_steps (300). L-BFGS evaluates 20 times
# (max_iter) a step here, so 80 makes 5 steps: one optimizer.step(closure) each, as one Trainer step. The
# fifth step's last update leaves pixels outside [0, 1]: the last correction matters.
NUM_STEPS, STEPS = 80, 5


# -- the tutorial's modules, as it writes them (less the device) -------------------------------------------
class ContentLoss(nn.Module):

    def __init__(self, target,):
        super(ContentLoss, self).__init__()
        self.target = target.detach()

    def forward(self, input):
        self.loss = F.mse_loss(input, self.target)  # kept on the module, graph and all, until the next forward
        return input


def gram_matrix(input):
    a, b, c, d = input.size()
    features = input.view(a * b, c * d)
    G = torch.mm(features, features.t())
    return G.div(a * b * c * d)


class StyleLoss(nn.Module):

    def __init__(self, target_feature):
        super(StyleLoss, self).__init__()
        self.target = gram_matrix(target_feature).detach()

    def forward(self, input):
        G = gram_matrix(input)
        self.loss = F.mse_loss(G, self.target)
        return input


class Normalization(nn.Module):
    def __init__(self, mean, std):
        super(Normalization, self).__init__()
        # plain attributes, neither parameters nor buffers
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def forward(self, img):
        return (img - self.mean) / self.std


def get_style_model_and_losses(cnn, normalization_mean, normalization_std, style_img, content_img,
                               content_layers=CONTENT_LAYERS, style_layers=STYLE_LAYERS):
    cnn = copy.deepcopy(cnn)
    normalization = Normalization(normalization_mean, normalization_std)
    content_losses = []
    style_losses = []
    model = nn.Sequential(normalization)

    i = 0  # increment every time we see a conv
    for layer in cnn.children():
        if isinstance(layer, nn.Conv2d):
            i += 1
            name = 'conv_{}'.format(i)
        elif isinstance(layer, nn.ReLU):
            name = 'relu_{}'.format(i)
            layer = nn.ReLU(inplace=False)  # the in-place one would change what the loss modules saw
        elif isinstance(layer, nn.MaxPool2d):
            name = 'pool_{}'.format(i)
        elif isinstance(layer, nn.BatchNorm2d):
            name = 'bn_{}'.format(i)
        else:
            raise RuntimeError('Unrecognized layer: {}'.format(layer.__class__.__name__))

        model.add_module(name, layer)

        if name in content_layers:
            target = model(content_img).detach()
            content_loss = ContentLoss(target)
            model.add_module("content_loss_{}".format(i), content_loss)
            content_losses.append(content_loss)

        if name in style_layers:
            target_feature = model(style_img).detach()
            style_loss = StyleLoss(target_feature)
            model.add_module("style_loss_{}".format(i), style_loss)
            style_losses.append(style_loss)

    # now we trim off the layers after the last content and style losses
    for i in range(len(model) - 1, -1, -1):
        if isinstance(model[i], ContentLoss) or isinstance(model[i], StyleLoss):
            break

    model = model[:(i + 1)]

    return model, style_losses, content_losses


def vgg_stand_in():
    """vgg19.features in miniature: 3x3 convolutions, in-place ReLUs, a max pool, and a tail the
    model trims off."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))


class StyleTransfer(nn.Module):
    """What run_style_transfer starts from, in one module so that the Trainer sees the image as a
    parameter: the frozen model with its loss modules inserted, the lists of those, the input image."""

    def __init__(self):
        super().__init__()
        content_img, style_img = torch.rand(1, 3, 8, 8), torch.rand(1, 3, 8, 8)
        self.model, self.style_losses, self.content_losses = get_style_model_and_losses(
            # the statistics as lists: torch.tensor() of the tutorial's tensors warns that it copies them
            vgg_stand_in().eval(), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], style_img, content_img)
        # "We want to optimize the input and not the model parameters"
        self.input_img = nn.Parameter(content_img.clone())  # input_img.requires_grad_(True)
        self.model.eval()
        self.model.requires_grad_(False)
        # The build's forwards left a loss (and its graph) on the loss modules inserted before the last
        # one, which the first forward of training replaces unread; dropped so that the harness can copy
        # the model (deepcopy refuses tensors with a graph).
        for module in self.style_losses + self.content_losses:
            if hasattr(module, "loss"):
                del module.loss


def scores(transfer):
    """The closure's forward: the loss modules fill in ``.loss``, summed and weighted."""
    transfer.model(transfer.input_img)
    style_score = 0
    content_score = 0

    for sl in transfer.style_losses:
        style_score += sl.loss
    for cl in transfer.content_losses:
        content_score += cl.loss

    style_score *= STYLE_WEIGHT
    content_score *= CONTENT_WEIGHT
    return style_score, content_score


# -- the hand-written loop: run_style_transfer ---------------------------------------------------------------
def style_hand(transfer, iterations):
    input_img = transfer.input_img
    optimizer = optim.LBFGS([input_img])

    run = [0]
    steps = 0
    while run[0] <= NUM_STEPS:

        def closure():
            # correct the values of updated input image
            with torch.no_grad():
                input_img.clamp_(0, 1)

            optimizer.zero_grad()
            style_score, content_score = scores(transfer)

            loss = style_score + content_score
            loss.backward()

            run[0] += 1
            return style_score + content_score

        optimizer.step(closure)
        steps += 1

    # a last correction...
    with torch.no_grad():
        input_img.clamp_(0, 1)
    assert steps == len(iterations), f"the tutorial's loop made {steps} steps, the Trainer makes {len(iterations)}"


# -- the ports ----------------------------------------------------------------------------------------------
class StyleTransferTrainer(Trainer):
    """What both ports share: L-BFGS over the image alone, and the last correction once training ends."""

    def configure_optimizers(self):
        return optim.LBFGS([self.model.input_img])

    def on_fit_start(self):
        self.run = [0]

    def on_fit_end(self):
        with torch.no_grad():
            self.model.input_img.clamp_(0, 1)


class ByClosure(StyleTransferTrainer):
    """The tutorial's closure handed to ``self.step``; the Trainer clears the gradients before each
    call (the tutorial's ``optimizer.zero_grad()``)."""

    automatic = False

    def training_step(self, iteration):
        input_img = self.model.input_img

        def closure():
            with torch.no_grad():
                input_img.clamp_(0, 1)

            style_score, content_score = scores(self.model)

            loss = style_score + content_score
            self.backward(loss)

            self.run[0] += 1
            return style_score + content_score

        self.step(closure=closure)


class Automatic(StyleTransferTrainer):
    """The closure's body returns its loss; the Trainer builds the closure, which calls this again
    for every evaluation after the first."""

    def training_step(self, iteration):
        with torch.no_grad():
            self.model.input_img.clamp_(0, 1)

        style_score, content_score = scores(self.model)

        self.run[0] += 1
        return style_score + content_score


@pytest.mark.parametrize("check", checks())
def test_neural_style_transfer_with_lbfgs_closure(check):
    compare(StyleTransfer, style_hand, ByClosure, fixed(range(STEPS)), check, steps=STEPS)


@pytest.mark.parametrize("check", checks())
def test_neural_style_transfer_with_lbfgs_in_automatic_mode(check):
    compare(StyleTransfer, style_hand, Automatic, fixed(range(STEPS)), check, steps=STEPS)
