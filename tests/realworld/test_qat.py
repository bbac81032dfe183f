"""Quantization-aware training in eager mode, as PyTorch's tutorial does it: pytorch/tutorials at commit
99bf69ec2b0ba0d24070f4d4f784dfaa6c588c05, advanced_source/static_quantization_tutorial.rst (its MobileNetV2,
``fuse_model(is_qat=True)``, ``train_one_epoch``, ``evaluate`` and section 5, "Quantization-aware training").

``prepare_qat`` swaps the fused Conv+BN(+ReLU) blocks for QAT modules (``ConvBnReLU2d``, ``ConvBn2d``) that
fold the batch norm into the weight in their forward and fake-quantize it per channel, and puts a fake
quantizer (``FusedMovingAvgObsFakeQuantize``) after every activation: each forward moves their observers'
``min_val``/``max_val`` and their ``scale``/``zero_point`` buffers in place, next to BatchNorm's statistics.
Residual adds go through ``nn.quantized.FloatFunctional`` (its own fake quantizer), and the input and output
through ``QuantStub``/``DeQuantStub``. Every epoch ``train_one_epoch`` calls ``model.train()`` and trains
``ntrain_batches``; after epoch 3 the batch-norm statistics are frozen (``apply(freeze_bn_stats)``), after
epoch 4 the observers (``apply(disable_observer)``: their ``observer_enabled`` buffers); after each epoch
``convert(qat_model.eval(), inplace=False)`` (which leaves the model in eval mode until the next epoch's
``train()``) builds a quantized copy that ``evaluate`` runs on the test batches.

Changes for a seconds-long test: two inverted-residual stages (``[1, 8, 1, 1]``, ``[6, 8, 2, 2]``: expansion 1
and 6, a residual add) in place of seven, 3 classes, 16x16 images, 6 epochs of 2 batches of 4 (8 of 20 of
30), one test batch (1000 of 50), random images in place of ImageNet (fixed lists in place of the shuffled
DataLoaders); the model is built in place of ``load_model``'s pretrained weights; the prints, timing and
scripted copies are left out. The tutorial's ``print('.')`` per batch is left out too.

The port: ``on_epoch_start`` calls ``model.train()``, ``on_epoch_end`` the freezing and the converted copy's
evaluation. The last epoch's end is not seen by the port (a pass ends when the next step asks for a batch,
and ``max_steps`` stops the run first); what it would freeze was frozen an epoch before.
"""
import pytest
import torch
import torch.nn as nn
from torch.ao.quantization import DeQuantStub, QuantStub

from safeloop import Trainer

from .harness import checks, compare

SETTING = [[1, 8, 1, 1], [6, 8, 2, 2]]
CLASSES, SIZE, BATCH, EPOCHS = 3, 16, 4, 6
num_train_batches = 2
num_eval_batches = 1
criterion = nn.CrossEntropyLoss()


def _make_divisible(v, divisor, min_value=None):
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    # Make sure that round down does not go down by more than 10%.
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNReLU(nn.Sequential):
    def __init__(self, in_planes, out_planes, kernel_size=3, stride=1, groups=1):
        padding = (kernel_size - 1) // 2
        super(ConvBNReLU, self).__init__(
            nn.Conv2d(in_planes, out_planes, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_planes, momentum=0.1),
            # Replace with ReLU
            nn.ReLU(inplace=False)
        )


class InvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio):
        super(InvertedResidual, self).__init__()
        self.stride = stride
        assert stride in [1, 2]

        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = self.stride == 1 and inp == oup

        layers = []
        if expand_ratio != 1:
            # pw
            layers.append(ConvBNReLU(inp, hidden_dim, kernel_size=1))
        layers.extend([
            # dw
            ConvBNReLU(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
            # pw-linear
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup, momentum=0.1),
        ])
        self.conv = nn.Sequential(*layers)
        # Replace torch.add with floatfunctional
        self.skip_add = nn.quantized.FloatFunctional()

    def forward(self, x):
        if self.use_res_connect:
            return self.skip_add.add(x, self.conv(x))
        else:
            return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=1000, width_mult=1.0, inverted_residual_setting=None, round_nearest=8):
        super(MobileNetV2, self).__init__()
        block = InvertedResidual
        input_channel = 32
        last_channel = 1280

        if inverted_residual_setting is None:
            inverted_residual_setting = [
                # t, c, n, s
                [1, 16, 1, 1],
                [6, 24, 2, 2],
                [6, 32, 3, 2],
                [6, 64, 4, 2],
                [6, 96, 3, 1],
                [6, 160, 3, 2],
                [6, 320, 1, 1],
            ]

        # only check the first element, assuming user knows t,c,n,s are required
        if len(inverted_residual_setting) == 0 or len(inverted_residual_setting[0]) != 4:
            raise ValueError("inverted_residual_setting should be non-empty "
                             "or a 4-element list, got {}".format(inverted_residual_setting))

        # building first layer
        input_channel = _make_divisible(input_channel * width_mult, round_nearest)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features = [ConvBNReLU(3, input_channel, stride=2)]
        # building inverted residual blocks
        for t, c, n, s in inverted_residual_setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(block(input_channel, output_channel, stride, expand_ratio=t))
                input_channel = output_channel
        # building last several layers
        features.append(ConvBNReLU(input_channel, self.last_channel, kernel_size=1))
        # make it nn.Sequential
        self.features = nn.Sequential(*features)
        self.quant = QuantStub()
        self.dequant = DeQuantStub()
        # building classifier
        self.classifier = nn.Sequential(
            nn.Dropout(0.2),
            nn.Linear(self.last_channel, num_classes),
        )

        # weight initialization
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out')
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.quant(x)
        x = self.features(x)
        x = x.mean([2, 3])
        x = self.classifier(x)
        x = self.dequant(x)
        return x

    # Fuse Conv+BN and Conv+BN+Relu modules prior to quantization
    # This operation does not change the numerics
    def fuse_model(self, is_qat=False):
        fuse_modules = torch.ao.quantization.fuse_modules_qat if is_qat else torch.ao.quantization.fuse_modules
        for m in self.modules():
            if type(m) == ConvBNReLU:
                fuse_modules(m, ['0', '1', '2'], inplace=True)
            if type(m) == InvertedResidual:
                for idx in range(len(m.conv)):
                    if type(m.conv[idx]) == nn.Conv2d:
                        fuse_modules(m.conv, [str(idx), str(idx + 1)], inplace=True)


class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self, name, fmt=':f'):
        self.name = name
        self.fmt = fmt
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

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


def evaluate(model, criterion, data_loader, neval_batches):
    model.eval()
    top1 = AverageMeter('Acc@1', ':6.2f')
    top5 = AverageMeter('Acc@5', ':6.2f')
    cnt = 0
    with torch.no_grad():
        for image, target in data_loader:
            output = model(image)
            loss = criterion(output, target)  # noqa: F841 (the tutorial's)
            cnt += 1
            acc1, acc5 = accuracy(output, target, topk=(1, 3))  # (1, 5): 3 classes here
            top1.update(acc1[0], image.size(0))
            top5.update(acc5[0], image.size(0))
            if cnt >= neval_batches:
                return top1, top5

    return top1, top5


def train_one_epoch(model, criterion, optimizer, data_loader, device, ntrain_batches):
    model.train()
    top1 = AverageMeter('Acc@1', ':6.2f')
    top5 = AverageMeter('Acc@5', ':6.2f')
    avgloss = AverageMeter('Loss', '1.5f')

    cnt = 0
    for image, target in data_loader:
        cnt += 1
        image, target = image.to(device), target.to(device)
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        acc1, acc5 = accuracy(output, target, topk=(1, 3))
        top1.update(acc1[0], image.size(0))
        top5.update(acc5[0], image.size(0))
        avgloss.update(loss, image.size(0))
        if cnt >= ntrain_batches:
            return

    print('Full imagenet train set:  * Acc@1 {top1.global_avg:.3f} Acc@5 {top5.global_avg:.3f}'
          .format(top1=top1, top5=top5))
    return


def qat_model_():
    """``load_model`` (a model built, not loaded), ``fuse_model(is_qat=True)``, the qconfig and ``prepare_qat``
    (the optimizer, built between fusing and preparing in the tutorial, is built by each loop: ``prepare_qat``
    swaps modules, but keeps the fused modules' parameters)."""
    qat_model = MobileNetV2(num_classes=CLASSES, inverted_residual_setting=SETTING)
    qat_model.fuse_model(is_qat=True)
    qat_model.qconfig = torch.ao.quantization.get_default_qat_qconfig('x86')
    torch.ao.quantization.prepare_qat(qat_model, inplace=True)
    return qat_model


def after_epoch(qat_model, nepoch, data_loader_test):
    if nepoch > 3:
        # Freeze quantizer parameters
        qat_model.apply(torch.ao.quantization.disable_observer)
    if nepoch > 2:
        # Freeze batch norm mean and variance estimates
        qat_model.apply(torch.nn.intrinsic.qat.freeze_bn_stats)

    # Check the accuracy after each epoch
    quantized_model = torch.ao.quantization.convert(qat_model.eval(), inplace=False)
    quantized_model.eval()
    top1, top5 = evaluate(quantized_model, criterion, data_loader_test, neval_batches=num_eval_batches)
    return top1.avg


def qat_hand(qat_model, data):
    data_loader, data_loader_test = data.train, data.test
    optimizer = torch.optim.SGD(qat_model.parameters(), lr=0.0001)
    for nepoch in range(EPOCHS):
        train_one_epoch(qat_model, criterion, optimizer, data_loader, torch.device('cpu'), num_train_batches)
        data.accuracies.append(after_epoch(qat_model, nepoch, data_loader_test))


class QAT(Trainer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.0001)

    def on_epoch_start(self):
        self.model.train()

    def training_step(self, batch):
        image, target = batch
        return criterion(self.model(image), target)

    def on_epoch_end(self):
        self.train_data.accuracies.append(after_epoch(self.model, self.state.epoch, self.train_data.test))


class ImageNet:
    def __init__(self):
        gen = torch.Generator().manual_seed(9)

        def batch():
            return (torch.randn(BATCH, 3, SIZE, SIZE, generator=gen),
                    torch.randint(CLASSES, (BATCH,), generator=gen))
        self.train = [batch() for _ in range(num_train_batches)]
        self.test = [batch() for _ in range(num_eval_batches)]
        self.accuracies = []

    def __iter__(self):
        return iter(self.train)


@pytest.mark.parametrize("check", checks())
def test_quantization_aware_training(check):
    runs = []

    def data(model):
        runs.append(ImageNet())
        return runs[-1]
    compare(qat_model_, qat_hand, QAT, data, check, steps=EPOCHS * num_train_batches)
    hand, watched, port = (run.accuracies for run in runs)
    assert watched == hand and port == hand[:-1]  # the port's last pass ends after the run


def test_the_observers_and_batch_norm_are_frozen():
    """After the run the observers are off and the batch norms frozen (the freezing ran), and the fake
    quantizers' scales moved (the observers ran)."""
    torch.manual_seed(0)
    model = qat_model_()
    start = {name: b.clone() for name, b in model.named_buffers()}
    qat_hand(model, ImageNet())
    fake_quants = [m for m in model.modules() if isinstance(m, torch.ao.quantization.FakeQuantizeBase)]
    assert fake_quants and all(not m.observer_enabled.item() for m in fake_quants)
    conv_bns = [m for m in model.modules() if isinstance(m, torch.ao.nn.intrinsic.qat.ConvBn2d)]
    assert len(conv_bns) >= 5 and all(m.freeze_bn for m in conv_bns)
    assert any(not torch.equal(b, start[name]) for name, b in model.named_buffers() if name.endswith("scale"))
