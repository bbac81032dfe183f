"""Non-finite values under ``precision="16-mixed"``, where the GradScaler skips the updates whose gradients overflow.

- MAE's stop on a non-finite loss: facebookresearch/mae at commit efb2a8062c206524e35e47d04501ed4f544c0ae8,
  engine_pretrain.py (``loss_value = loss.item()``; ``if not math.isfinite(loss_value): ... sys.exit(1)``, before
  the loss reaches the scaler), with the model, scaler and loop of ``test_mae`` (float16 autocast, ``accum_iter``
  2). A batch of the first epoch holds a NaN pixel, so the second micro-batch of the second update has a NaN loss:
  the loop exits there, its first micro-batch's gradients never applied. The port leaves out its own
  ``math.isfinite`` test and sets ``on_nonfinite="error"``: the same step stops with a ``NonFiniteError``, the weights,
  AdamW's state and the loss scale as the loop left them. Changes as ``test_mae``'s; ``sys.exit(1)`` raised as
  ``SystemExit(1)`` and caught.
- A NaN gradient behind a finite loss (``sqrt`` at 0: an infinite derivative times 0). docs/trainer.md
  (Precision) says ``on_nonfinite`` works the same in each precision, and docs/checkpoints.md (Non-finite values)
  that ``error`` stops on a NaN/Inf loss or gradient before the optimizer step. Under 32 and bf16-mixed it stops at
  step 1; under 16-mixed the gradients are left to the GradScaler, which skips every update and halves the scale
  each time, as docs/checkpoints.md says. So is a NaN loss in manual mode accumulating over steps (``self.step()``
  every second step, as docs/checkpoints.md describes it: "a NaN loss of an earlier step shows in the gradients"):
  the update step stops, under 16-mixed too (its losses are kept until the update).
- A GradScaler made with ``init_scale=1024``: pytorch/tutorials at commit db77dcf6e3637924f43852c014f2af9978b0f891,
  recipes_source/recipes/amp_recipe.py (the loop of ``test_amp_recipe``) with ``torch.amp.GradScaler(device,
  init_scale=1024.0)``, a ``GradScaler`` argument the recipe leaves at its default: the port returns that scaler
  from ``configure_grad_scaler``.
- A failed step under 16-mixed: the port of ``test_amp_recipe`` with a hook that raises once, after the Trainer
  unscaled the gradients (``on_before_optimizer_step`` at step 3). docs/checkpoints.md says the failed step is
  abandoned, "parameters and optimizer state are unchanged"; under 32 and bf16-mixed a second ``fit()`` goes on from
  there, and under 16-mixed too: the abandoned step leaves the GradScaler as the step found it.
"""

import pytest
import torch

from safeloop import NonFiniteError, StepError, Trainer

from . import test_amp_recipe as recipe, test_mae as mae
from .harness import assert_same, checks, compare

POISONED = 3  # the batch whose loss is NaN: the second micro-batch of the second update


def poisoned_images():
    data = mae.images()
    data[POISONED][0][0, 0, 0, 0] = float("nan")
    return data


class MAEOnNonfinite(mae.MAETrainer):
    """``test_mae``'s port without its own ``math.isfinite`` test: ``on_nonfinite="error"`` stops the step."""

    def training_step(self, batch):
        samples, _ = batch
        self.data_iter_step += 1
        if self.data_iter_step % self.args.accum_iter == 0:
            mae.adjust_learning_rate(self.adamw, self.data_iter_step / len(self.train_data) + self.state.epoch,
                                     self.args)
        loss, _, _ = self.model(samples, mask_ratio=self.args.mask_ratio)
        return loss


def mae_hand_kept(model, data_loader, kept):
    args = mae.Args()
    optimizer = mae.make_optimizer(model, args)
    loss_scaler = mae.NativeScalerWithGradNormCount()
    kept.extend([optimizer, loss_scaler._scaler])
    for epoch in range(mae.EPOCHS):
        mae.train_one_epoch(model, data_loader, optimizer, epoch, loss_scaler, args)


def test_mae_stop_on_a_nan_loss_is_on_nonfinite_error():
    torch.manual_seed(0)
    ref = mae.MaskedAutoencoderViT()
    torch.manual_seed(0)
    ours = mae.MaskedAutoencoderViT()
    kept = []
    torch.manual_seed(1)
    with pytest.raises(SystemExit):
        mae_hand_kept(ref, poisoned_images(), kept)
    optimizer, scaler = kept
    torch.manual_seed(1)
    trainer = MAEOnNonfinite(model=ours, train_data=poisoned_images(), max_epochs=mae.EPOCHS, device="cpu",
                             progress=False, loggers=(), grad_accum=mae.ACCUM_ITER, precision="16-mixed",
                             on_nonfinite="error")
    with pytest.raises(NonFiniteError, match="step 2"):
        trainer.fit()
    assert trainer.state.step == POISONED // mae.ACCUM_ITER
    assert_same(ours, ref)
    theirs, mine = optimizer.state_dict()["state"], trainer.optimizers["optimizer"].state_dict()["state"]
    assert theirs.keys() == mine.keys()
    assert all(torch.equal(theirs[k][s], mine[k][s]) for k in theirs for s in theirs[k])
    assert trainer.scaler.state_dict() == scaler.state_dict()


class Sqrt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        out = self.lin(x)
        return torch.sqrt(out * 0).sum() + out.float().pow(2).mean()  # the sqrt's gradient: inf * 0 = NaN


class SqrtTrainer(Trainer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, x):
        return self.model(x)


def sqrt_fit(precision):
    torch.manual_seed(0)
    data = [torch.randn(8, 4) for _ in range(4)]
    trainer = SqrtTrainer(model=Sqrt(), train_data=data, max_steps=4, device="cpu", progress=False, loggers=(),
                          precision=precision, on_nonfinite="error")
    trainer.fit()
    return trainer


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_a_nan_gradient_behind_a_finite_loss_stops_the_step(precision):
    with pytest.raises(NonFiniteError, match="the losses are finite"):
        sqrt_fit(precision)


def test_a_nan_gradient_behind_a_finite_loss_is_left_to_the_grad_scaler_under_16_mixed():
    """docs/checkpoints.md: under precision=16 the GradScaler judges the gradients; it skips each update and lowers
    its scale, as in a hand-written loop, and nothing is trained."""
    trainer = sqrt_fit("16-mixed")
    assert trainer.state.step == 4 and trainer.scaler.get_scale() == 2.0 ** 16 / 2 ** 4
    torch.manual_seed(0)  # as sqrt_fit draws them: the data, then the model
    [torch.randn(8, 4) for _ in range(4)]
    assert torch.equal(trainer.model.lin.weight, Sqrt().lin.weight)


def init_scale_hand(net, batches):
    opt = torch.optim.SGD(net.parameters(), lr=0.001)
    scaler = torch.amp.GradScaler(recipe.device, init_scale=1024.0)
    for input, target in batches:
        with torch.autocast(device_type=recipe.device, dtype=torch.float16):
            output = net(input)
            loss = recipe.loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    batches.scale = scaler.get_scale()


class OwnScaler(recipe.AMP):
    def configure_grad_scaler(self):
        return torch.amp.GradScaler(self.device.type, init_scale=1024.0)


@pytest.mark.parametrize("check", checks())
def test_a_grad_scaler_with_its_own_initial_scale(check):
    compare(recipe.model, init_scale_hand, OwnScaler, lambda model: recipe.Batches(), check,
            steps=recipe.num_batches, precision="16-mixed")


class FailsOnce(recipe.AMP):
    failed = False

    def on_before_optimizer_step(self, name, optimizer):
        if self.state.step + 1 == 3 and not self.failed:
            self.failed = True
            raise ValueError("a transient failure")

    def on_fit_end(self):  # the recipe's writes the scale onto its data, which this test does not compare
        pass


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
def test_a_fit_goes_on_after_a_failed_step(precision):
    torch.manual_seed(0)
    trainer = FailsOnce(model=recipe.model(), train_data=recipe.Batches(), max_steps=recipe.num_batches, device="cpu",
                        progress=False, loggers=(), precision=precision)
    with pytest.raises(StepError, match="step 3 failed and was abandoned .*ValueError: a transient failure"):
        trainer.fit()
    trainer.fit()
    assert trainer.state.step == recipe.num_batches


class EverySecondStep(Trainer):
    """Manual mode, one update every second step, each loss halved (as ``loss / accum_iter``)."""
    automatic = False

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=0.01)

    def training_step(self, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y) / 2
        self.backward(loss)
        if self.state.step % 2 == 1:
            self.step()
        return loss


def accumulated_fit(precision):
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 4, generator=gen) * (float("nan") if i == 2 else 1), torch.randn(8, 2, generator=gen))
            for i in range(8)]
    torch.manual_seed(0)
    trainer = EverySecondStep(model=torch.nn.Linear(4, 2), train_data=data, max_steps=8, device="cpu", progress=False,
                              loggers=(), precision=precision, on_nonfinite="error")
    trainer.fit()


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
def test_a_nan_loss_of_a_step_without_an_update_stops_the_next_update(precision):
    with pytest.raises(NonFiniteError, match="step 4"):
        accumulated_fit(precision)
