"""Automatic mixed precision as PyTorch's recipe writes it: pytorch/tutorials at commit
db77dcf6e3637924f43852c014f2af9978b0f891, recipes_source/recipes/amp_recipe.py (``make_model``, "All together:
Automatic Mixed Precision" and "Inspecting/modifying gradients (e.g., clipping)").

The forward and the loss under ``torch.autocast(dtype=torch.float16)`` (linear layers in float16,
``mse_loss`` in float32), ``scaler.scale(loss).backward()``, then either ``scaler.step(opt)`` directly, or
``scaler.unscale_(opt)`` and ``clip_grad_norm_(max_norm=0.1)`` first; ``scaler.update()`` and
``opt.zero_grad()``. ``GradScaler`` starts at 2**16, so the first steps overflow in float16: their updates
are skipped and the scale halves, until it fits.

Changes for a seconds-long test: batches of 8, widths of 16 (512 and 4096), 6 batches in one epoch (50 in 3),
inputs and targets drawn ten times wider than ``randn`` so that the first three updates overflow and are skipped;
CPU in place of CUDA: ``torch.autocast(device_type="cpu", dtype=torch.float16)``, and
``torch.amp.GradScaler("cpu")`` for ``torch.cuda.amp.GradScaler()`` (which disables itself without CUDA);
``.cuda()`` and the timers left out.

The port: ``precision="16"`` (autocast to float16 and a GradScaler for the device), and ``grad_clip=0.1``
for the clipping variant (unscaled before clipping, as the recipe says to).
"""
import pytest
import torch

from safeloop import Trainer

from .harness import checks, compare_runs

batch_size, in_size, out_size, num_layers, num_batches = 8, 16, 16, 3, 6
device = 'cpu'


def make_model(in_size, out_size, num_layers):
    layers = []
    for _ in range(num_layers - 1):
        layers.append(torch.nn.Linear(in_size, in_size))
        layers.append(torch.nn.ReLU())
    layers.append(torch.nn.Linear(in_size, out_size))
    return torch.nn.Sequential(*tuple(layers))  # .cuda()


loss_fn = torch.nn.MSELoss()


def amp_hand(net, batches, clip=False):
    use_amp = True
    opt = torch.optim.SGD(net.parameters(), lr=0.001)
    scaler = torch.amp.GradScaler(device, enabled=use_amp)  # torch.cuda.amp.GradScaler(enabled=use_amp)
    for input, target in batches:
        with torch.autocast(device_type=device, dtype=torch.float16, enabled=use_amp):
            output = net(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        if clip:
            # Unscales the gradients of optimizer's assigned parameters in-place
            scaler.unscale_(opt)
            # Since the gradients of optimizer's assigned parameters are now unscaled, clips as usual.
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.1)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()  # set_to_none=True here can modestly improve performance
    batches.scale = scaler.get_scale()


def amp_clip_hand(net, batches):
    amp_hand(net, batches, clip=True)


class AMP(Trainer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.001)

    def training_step(self, batch):
        input, target = batch
        output = self.model(input)
        return loss_fn(output, target)

    def on_fit_end(self):
        self.train_data.scale = self.scaler.get_scale()


class Batches(list):
    def __init__(self):
        gen = torch.Generator().manual_seed(21)
        super().__init__((torch.randn(batch_size, in_size, generator=gen) * 10,
                          torch.randn(batch_size, out_size, generator=gen) * 10) for _ in range(num_batches))
        self.scale = None


def model():
    return make_model(in_size, out_size, num_layers)


@pytest.mark.parametrize("clip", [False, True], ids=["scaled", "unscaled_and_clipped"])
@pytest.mark.parametrize("check", checks())
def test_amp_recipe_with_a_grad_scaler(check, clip):
    extra = {"grad_clip": 0.1} if clip else {}
    runs = compare_runs(model, amp_clip_hand if clip else amp_hand, AMP, Batches, check, steps=num_batches,
                        precision="16", **extra)
    hand, watched, port = (run.scale for run in runs)
    assert watched == hand and port == hand
    assert hand < 2.0 ** 16, "no update overflowed: the skipped steps are not exercised"
