"""diffusers' own training pieces (``UNet2DModel``, ``DDPMScheduler.add_noise`` / ``get_velocity``,
``diffusers.optimization.get_cosine_schedule_with_warmup``, ``diffusers.training_utils.EMAModel`` and ``compute_snr``,
``DDPMPipeline``), driven by the loops of diffusers' examples with a tiny UNet on CPU:

- examples/unconditional_image_generation/train_unconditional.py: noise and timesteps drawn each micro-batch,
  ``noise_scheduler.add_noise``, ``model(noisy_images, timesteps).sample``, the MSE to the noise, inside
  ``accelerator.accumulate(model)`` with ``Accelerator(gradient_accumulation_steps=2)``, ``accelerator.clip_grad_norm_``
  under ``sync_gradients``, AdamW, the cosine schedule with warm-up, ``ema_model.step(model.parameters())`` after each
  update, and at each epoch's end a ``DDPMPipeline`` run on the EMA weights (``store`` / ``copy_to`` / ``restore``);
- the v-prediction target (``noise_scheduler.get_velocity``) with min-SNR weights (``compute_snr``, as
  examples/text_to_image/train_text_to_image.py weighs its loss), and samples drawn by hand between the micro-batches
  of an update (the scheduler's ``step`` loop under ``torch.no_grad()``, generation during training).

Each runs bare, under ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script)
and with a ``safeloop.GraphGuard`` in the loop (``with guard.step():`` around each micro-batch, ``guard.check(loss)``
before ``accelerator.backward(loss)``), under every check mode: the UNet, the EMA's shadow parameters and step count,
the optimizer's and the schedule's state, the losses, the samples and torch's RNG state at the end come out bit for bit
the same, with no warning the bare run does not give. The first loop also as a ``safeloop.Trainer`` (``grad_clip``,
``grad_accum``, the schedule from ``configure_optimizers``, the EMA stepped in ``on_step_end``).

Then the mistakes of such loops: sampling during training without ``torch.no_grad()`` with the images kept, a class
embedding computed once before the loop from a trained (or meant frozen) embedding layer, noise built once outside the
loop with ``requires_grad``, a hand-made EMA updated without ``torch.no_grad()``, a target computed from the model.

Written against diffusers 0.42.1, accelerate 1.15.0 and torch 2.13 on CPU.
"""
import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel  # noqa: E402
from diffusers.optimization import get_cosine_schedule_with_warmup  # noqa: E402
from diffusers.training_utils import EMAModel, compute_snr  # noqa: E402

import safeloop  # noqa: E402
from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import CarriedGraphError, GraphLeakWarning, GraphLifecycleWarning, GraphReuseError  # noqa: E402
from safeloop.watch import Watch  # noqa: E402
from tests.libraries.compare import same, stepped, three_runs  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402

TIMESTEPS = 100  # num_train_timesteps: small, so that a tiny run sees all the schedule's regions


def fresh():
    """accelerate keeps one ``AcceleratorState`` per process: each run starts from none, as a new script would."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_state(tmp_path, monkeypatch):
    """A fresh ``AcceleratorState``, and a working directory of the test's own (where the guard writes its graph
    pictures)."""
    monkeypatch.chdir(tmp_path)
    fresh()
    yield
    fresh()


# -- tiny model and data ------------------------------------------------------------------------------------------
def tiny_unet(**kwargs):
    """train_unconditional.py's ``UNet2DModel`` at 8x8: two blocks of 8 and 16 channels, one layer each, the second
    with attention (``AttnDownBlock2D`` / ``AttnUpBlock2D``), groups of 4 channels in each norm."""
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4, attention_head_dim=8,
                       **kwargs)


def images(n=20, seed=3):
    """``n`` seeded 3x8x8 "images" in [-1, 1], as the example's ``Normalize([0.5], [0.5])`` leaves them."""
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 3, 8, 8, generator=gen) * 2 - 1)


def build():
    fresh()
    return tiny_unet(), images()


def hooks(guard, accelerator):
    """(step, backward) of a loop: ``with guard.step():`` and ``guard.check(loss); accelerator.backward(loss)``
    (the pairing docs/guard.md shows for accelerate), or a null context and ``accelerator.backward``."""
    if guard is None:
        return contextlib.nullcontext, accelerator.backward

    def backward(loss):
        guard.check(loss)
        accelerator.backward(loss)
    return guard.step, backward


def min_snr_loss(noise_scheduler, model_output, target, timesteps, snr_gamma):
    """train_text_to_image.py's min-SNR weighting (https://huggingface.co/papers/2303.09556)."""
    snr = compute_snr(noise_scheduler, timesteps)
    mse_loss_weights = torch.stack([snr, snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    if noise_scheduler.config.prediction_type == "epsilon":
        mse_loss_weights = mse_loss_weights / snr
    elif noise_scheduler.config.prediction_type == "v_prediction":
        mse_loss_weights = mse_loss_weights / (snr + 1)
    loss = F.mse_loss(model_output.float(), target.float(), reduction="none")
    loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
    return loss.mean()


def sample_by_hand(model, noise_scheduler, generator, steps=4, batch_size=2):
    """The sampling loop of diffusers' quicktour: a fresh scheduler of the same config, ``set_timesteps``, then
    ``model(image, t).sample`` and ``scheduler.step(...).prev_sample`` for each timestep."""
    scheduler = DDPMScheduler.from_config(noise_scheduler.config)
    scheduler.set_timesteps(steps)
    image = torch.randn((batch_size, 3, 8, 8), generator=generator)
    for t in scheduler.timesteps:
        model_output = model(image, t).sample
        image = scheduler.step(model_output, t, image, generator=generator).prev_sample
    return image


# -- the loops ----------------------------------------------------------------------------------------------------
def unconditional_loop(model, data, guard=None, epochs=2, prediction_type="epsilon", snr_gamma=None,
                       sample_every=None, pipeline_at_epoch_end=True):
    """train_unconditional.py's loop at tiny sizes (5 micro-batches of 4 an epoch, an update every 2: the last of
    each epoch is of one micro-batch, ``GradientState.end_of_dataloader``)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS, prediction_type=prediction_type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-08)
    train_dataloader = DataLoader(data, batch_size=4, shuffle=True)
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                   num_training_steps=len(train_dataloader) * epochs // 2)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    ema_model = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=3 / 4,
                         model_cls=UNet2DModel, model_config=model.config)
    step, backward = hooks(guard, accelerator)
    losses, lrs, samples = [], [], []
    generator = torch.Generator().manual_seed(5)
    for _epoch in range(epochs):
        model.train()
        for (clean_images,) in train_dataloader:
            with step():
                # Sample noise that we'll add to the images
                noise = torch.randn(clean_images.shape, dtype=clean_images.dtype, device=clean_images.device)
                bsz = clean_images.shape[0]
                # Sample a random timestep for each image
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                          device=clean_images.device).long()
                noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
                with accelerator.accumulate(model):
                    model_output = model(noisy_images, timesteps).sample
                    if prediction_type == "epsilon":
                        target = noise
                    else:
                        target = noise_scheduler.get_velocity(clean_images, noise, timesteps)
                    if snr_gamma is None:
                        loss = F.mse_loss(model_output.float(), target.float())
                    else:
                        loss = min_snr_loss(noise_scheduler, model_output, target, timesteps, snr_gamma)
                    backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    ema_model.step(model.parameters())
            losses.append(loss.detach().item())
            lrs.append(lr_scheduler.get_last_lr()[0])
            if sample_every and len(losses) % sample_every == 0:  # inside an accumulation window too
                model.eval()
                with torch.no_grad():
                    samples.append(sample_by_hand(model, noise_scheduler, generator))
                model.train()
        if pipeline_at_epoch_end:  # generate sample images for visual inspection, with the EMA's weights
            unet = accelerator.unwrap_model(model)
            ema_model.store(unet.parameters())
            ema_model.copy_to(unet.parameters())
            pipeline = DDPMPipeline(unet=unet, scheduler=noise_scheduler)
            pipeline.set_progress_bar_config(disable=True)
            pipe_generator = torch.Generator(device=pipeline.device).manual_seed(0)
            samples.append(pipeline(generator=pipe_generator, batch_size=2, num_inference_steps=4,
                                    output_type="np").images)
            ema_model.restore(unet.parameters())
    return {"model": accelerator.unwrap_model(model), "ema": ema_model.state_dict(),
            "optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(), "losses": losses,
            "lrs": lrs, "samples": [torch.as_tensor(s) for s in samples], "rng": torch.get_rng_state()}


@pytest.mark.parametrize("check", checks())
def test_train_unconditional_loop(check):
    """train_unconditional.py: ``accelerator.accumulate``, clipping under ``sync_gradients``, the cosine schedule
    with warm-up, ``EMAModel.step`` after each update, a ``DDPMPipeline`` on the EMA weights each epoch."""
    ref = three_runs(build, unconditional_loop, check)
    assert len(ref["losses"]) == 10 and ref["ema"]["optimization_step"] == 6 and len(ref["samples"]) == 2


@pytest.mark.parametrize("check", checks())
def test_v_prediction_min_snr_with_samples_between_micro_batches(check):
    """``DDPMScheduler(prediction_type="v_prediction")``, the target ``noise_scheduler.get_velocity(clean_images,
    noise, timesteps)`` and the min-SNR weights of ``compute_snr`` (``snr_gamma=5``); every third micro-batch (so
    inside an accumulation window, gradients held) two samples drawn by hand under ``torch.no_grad()`` with the
    training weights in eval mode, then ``model.train()``."""
    ref = three_runs(build, lambda *a, guard=None: unconditional_loop(
        *a, guard=guard, prediction_type="v_prediction", snr_gamma=5.0, sample_every=3, pipeline_at_epoch_end=False),
        check)
    assert len(ref["samples"]) == 3 and all(torch.isfinite(s).all() for s in ref["samples"])


class DDPMTrainer(safeloop.Trainer):
    """train_unconditional.py's step as a ``training_step``: AdamW and the cosine schedule with warm-up from
    ``configure_optimizers`` (stepped after every update), ``grad_clip=1.0`` and ``grad_accum=2`` as settings, the
    EMA stepped in ``on_step_end`` (after each update)."""

    def __init__(self, *, epochs, **kwargs):
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
        self.epochs = epochs
        super().__init__(**kwargs)
        self.ema_model = EMAModel(self.model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0,
                                  power=3 / 4, model_cls=UNet2DModel, model_config=self.model.config)
        self.losses = []

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.95, 0.999), weight_decay=1e-6,
                                      eps=1e-08)
        lr_scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                       num_training_steps=len(self.train_data) * self.epochs // 2)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}

    def training_step(self, batch):
        (clean_images,) = batch
        noise = torch.randn(clean_images.shape, dtype=clean_images.dtype, device=clean_images.device)
        timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (clean_images.shape[0],),
                                  device=clean_images.device).long()
        noisy_images = self.noise_scheduler.add_noise(clean_images, noise, timesteps)
        loss = F.mse_loss(self.model(noisy_images, timesteps).sample.float(), noise.float())
        self.losses.append(loss.item())
        return loss

    def on_step_end(self, losses):
        self.ema_model.step(self.model.parameters())


@pytest.mark.parametrize("check", checks())
def test_trainer_port_trains_as_the_accelerate_loop(check):
    """``DDPMTrainer`` on a ``DataLoader(shuffle=True)`` of the same images, from the same seeds: the UNet, the EMA,
    the optimizer's and the schedule's state, the losses and torch's RNG state as the accelerate loop (without its
    epoch-end pipeline) leaves them, bit for bit."""
    torch.manual_seed(0)
    model, data = build()
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = unconditional_loop(model, data, pipeline_at_epoch_end=False)
    torch.manual_seed(0)
    model, data = build()
    torch.manual_seed(1)
    with strict(own):
        trainer = DDPMTrainer(epochs=2, model=model, train_data=DataLoader(data, batch_size=4, shuffle=True),
                              max_epochs=2, grad_clip=1.0, grad_accum=2, device="cpu", progress=False, loggers=(),
                              guard={"check": check})
        trainer.fit()
    assert trainer.state.step == 6
    keys = ("model", "ema", "optimizer", "lr_scheduler", "losses", "rng")
    same({"model": trainer.model, "ema": trainer.ema_model.state_dict(),
          "optimizer": trainer.optimizers["optimizer"].state_dict(),
          "lr_scheduler": trainer.schedulers["optimizer"].state_dict(), "losses": trainer.losses,
          "rng": torch.get_rng_state()}, {k: ref[k] for k in keys})


# -- the mistakes -------------------------------------------------------------------------------------------------
def plain_build():
    """The UNet and the images as one tensor (the mistakes' loops are plain: no accelerate)."""
    return tiny_unet(), images()[:][0]


def batches(data, size=4):
    return [data[i:i + size] for i in range(0, len(data), size)]


def noised(noise_scheduler, clean_images):
    """The example's three lines: noise and timesteps drawn for this batch, the images noised."""
    noise = torch.randn(clean_images.shape, dtype=clean_images.dtype, device=clean_images.device)
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean_images.shape[0],)).long()
    return noise_scheduler.add_noise(clean_images, noise, timesteps), noise, timesteps


def backward_of(guard):
    return guard.backward if guard is not None else torch.Tensor.backward


def sampling_loop(model, data, guard=None, fix=False, epochs=2):
    """Samples drawn by hand after every second update to watch training go, and kept (``samples.append(image)``);
    the mistake: drawn without ``torch.no_grad()``, so each keeps the graph of its 4 UNet forwards; ``fix``: under
    it."""
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward = backward_of(guard)
    generator = torch.Generator().manual_seed(5)
    samples, losses = [], []
    for _epoch in range(epochs):
        for clean_images in batches(data):
            with stepped(guard):
                noisy_images, noise, timesteps = noised(noise_scheduler, clean_images)
                loss = F.mse_loss(model(noisy_images, timesteps).sample, noise)
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) % 2 == 0:
                model.eval()
                with torch.no_grad() if fix else contextlib.nullcontext():
                    image = sample_by_hand(model, noise_scheduler, generator, steps=2)
                samples.append(image)
                model.train()
    return {"model": model, "optimizer": optimizer.state_dict(), "losses": losses, "samples": samples,
            "graphs": sum(s.grad_fn is not None for s in samples)}


def test_samples_drawn_without_no_grad_keep_graphs_and_the_no_grad_fix_trains():
    """Bare, every kept sample holds a graph of the UNet (its saved activations stay alive for the whole run); under
    ``torch.no_grad()`` none does, and the loop trains quiet and bit for bit alike bare, watched and guarded."""
    torch.manual_seed(0)
    assert sampling_loop(*plain_build())["graphs"] == 5
    ref = three_runs(plain_build, lambda *a, guard=None: sampling_loop(*a, guard=guard, fix=True), "always")
    assert ref["graphs"] == 0


@pytest.mark.parametrize("place", ["guard", "watch"])
def test_samples_drawn_without_no_grad_and_kept_are_warned(place):
    """The kept samples: a ``GraphLeakWarning`` naming ``samples``, with ``torch.no_grad()`` as the fix, with a
    ``GraphGuard`` and under ``watch``."""
    torch.manual_seed(0)
    built = plain_build()
    with pytest.warns(GraphLeakWarning, match=r"the tensors added to `samples` keep their autograd graphs.*under "
                                              r"torch\.no_grad\(\)"):
        if place == "watch":
            with Watch(GraphGuard(check="always"), __file__):
                sampling_loop(*built)
        else:
            sampling_loop(*built, guard=GraphGuard(built[0], check="always"))


def class_build():
    """A class-conditional UNet (``class_embed_type="identity"``: ``class_labels`` is the embedding added to the
    timestep's, 32 wide) and a label encoder, ``nn.Embedding(4, 32)``, as a text encoder stands to a text-to-image
    UNet; the images' classes are their index modulo 4."""
    return tiny_unet(class_embed_type="identity"), nn.Embedding(4, 32), images()[:][0]


def class_loop(model, label_encoder, data, guard=None, fix=None, frozen=False):
    """The class embeddings computed once before the loop (``class_emb = label_encoder(torch.arange(4))``) and
    indexed by each batch's labels. ``frozen``: the encoder is left out of the optimizer (meant frozen, its
    ``requires_grad`` left on, as a text encoder without ``requires_grad_(False)``). ``fix``: ``"recompute"``, the
    embeddings of each batch computed inside the loop; ``"no_grad"``, computed once under ``torch.no_grad()``."""
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
    params = list(model.parameters()) + ([] if frozen else list(label_encoder.parameters()))
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    backward = backward_of(guard)
    labels = torch.arange(len(data)) % 4
    if fix == "no_grad":
        with torch.no_grad():
            class_emb = label_encoder(torch.arange(4))
    else:
        class_emb = label_encoder(torch.arange(4))
    for _epoch in range(2):
        for clean_images, batch_labels in zip(batches(data), batches(labels)):
            with stepped(guard):
                noisy_images, noise, timesteps = noised(noise_scheduler, clean_images)
                class_labels = label_encoder(batch_labels) if fix == "recompute" else class_emb[batch_labels]
                loss = F.mse_loss(model(noisy_images, timesteps, class_labels=class_labels).sample, noise)
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return {"model": model, "label_encoder": label_encoder, "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("place", ["guard", "watch"])
def test_class_embedding_computed_before_the_loop_is_stopped_at_the_first_step(place, frozen):
    """The embeddings computed once with their graph: stopped at step 1, before any gradient or update, naming
    ``class_emb``, with "recompute `class_emb` inside the loop" and ``torch.no_grad()`` for a constant (first for a
    frozen encoder, which no optimizer holds)."""
    torch.manual_seed(0)
    built = class_build()
    start = {"model": {k: v.clone() for k, v in built[0].state_dict().items()}, "encoder": built[1].weight.clone()}
    pattern = r"step 1, .*held by `(local )?class_emb`.*To fix: " + (
        r"if it is meant as a constant.*compute it under `torch\.no_grad\(\)`; or recompute `class_emb` inside the loop"
        if frozen else
        r"recompute `class_emb` inside the loop.*or compute it under `torch\.no_grad\(\)`")
    with pytest.raises(GraphReuseError, match=pattern):
        if place == "watch":
            with Watch(GraphGuard(check="always"), __file__):
                class_loop(*built, frozen=frozen)
        else:
            class_loop(*built, guard=GraphGuard(built[0], check="always"), frozen=frozen)
    same({"model": built[0].state_dict(), "encoder": built[1].weight}, start)
    assert all(p.grad is None for p in built[0].parameters())


@pytest.mark.parametrize("fix, frozen", [("recompute", False), ("no_grad", True)])
def test_class_embedding_fixed_as_advised_trains(fix, frozen):
    """A trained encoder's embeddings recomputed inside the loop, a frozen one's computed under
    ``torch.no_grad()``: quiet, bit for bit alike bare, watched and guarded; the trained encoder trains."""
    ref = three_runs(class_build, lambda *a, guard=None: class_loop(*a, guard=guard, fix=fix, frozen=frozen),
                     "always")
    torch.manual_seed(0)
    untrained = class_build()[1]
    assert torch.equal(ref["label_encoder"].weight, untrained.weight) == frozen


def hoisted_noise_loop(model, data, guard=None, steps=6):
    """Overfitting one batch to debug a loop, the noise drawn once with ``requires_grad=True`` and the images noised
    once, above the loop (the mistake: the loop back-propagates ``noisy_images``' graph every step)."""
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward = backward_of(guard)
    clean_images = data[:4]
    noise = torch.randn(clean_images.shape, requires_grad=True)
    timesteps = torch.randint(0, TIMESTEPS, (4,)).long()
    noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
    for _ in range(steps):
        with stepped(guard):
            loss = F.mse_loss(model(noisy_images, timesteps).sample, noise)
            backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return {"model": model, "optimizer": optimizer.state_dict()}


def one_batch_loop(model, data, guard=None, steps=6):
    """The fix: the example's lines inside the loop, noise and timesteps drawn for each step (without
    ``requires_grad``)."""
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward = backward_of(guard)
    clean_images = data[:4]
    for _ in range(steps):
        with stepped(guard):
            noisy_images, noise, timesteps = noised(noise_scheduler, clean_images)
            loss = F.mse_loss(model(noisy_images, timesteps).sample, noise)
            backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return {"model": model, "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("place", ["guard", "watch"])
def test_noise_drawn_once_with_requires_grad_is_stopped_at_the_first_step(place):
    """``noisy_images`` built above the loop from noise that requires grad: stopped at step 1, before any update,
    naming ``noisy_images`` (whose graph saves tensors, in ``add_noise``'s products) and advising to recompute it
    inside the loop; the fix, drawn inside the loop, trains quiet and bit for bit alike bare, watched and guarded."""
    torch.manual_seed(0)
    built = plain_build()
    start = {k: v.clone() for k, v in built[0].state_dict().items()}
    pattern = r"step 1, .*held by `(local )?noisy_images`.*To fix: recompute `noisy_images` inside the loop"
    with pytest.raises(GraphReuseError, match=pattern):
        if place == "watch":
            with Watch(GraphGuard(check="always"), __file__):
                hoisted_noise_loop(*built)
        else:
            hoisted_noise_loop(*built, guard=GraphGuard(built[0], check="always"))
    same(built[0].state_dict(), start)


def test_noise_drawn_inside_the_loop_trains():
    """The advised fix: quiet, bit for bit alike bare, watched and guarded."""
    three_runs(plain_build, one_batch_loop, "always")


def hand_ema_loop(model, data, guard=None, fix=False):
    """An EMA of the weights kept by hand, as many DDPM repositories do (``ema[i] = decay * ema[i] + (1 - decay) *
    p`` after each update), for the samples; the mistake: without ``torch.no_grad()`` each average is a graph over
    every earlier one, kept as long as the run; ``fix``: under it (what ``EMAModel.step`` does)."""
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward = backward_of(guard)
    ema = [p.detach().clone() for p in model.parameters()]
    for _epoch in range(2):
        for clean_images in batches(data):
            with stepped(guard):
                noisy_images, noise, timesteps = noised(noise_scheduler, clean_images)
                loss = F.mse_loss(model(noisy_images, timesteps).sample, noise)
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad() if fix else contextlib.nullcontext():
                    for i, p in enumerate(model.parameters()):
                        ema[i] = 0.9 * ema[i] + 0.1 * p
    return {"model": model, "optimizer": optimizer.state_dict(), "ema": [e.detach() for e in ema],
            "graphs": sum(e.grad_fn is not None for e in ema)}


def test_hand_made_ema_under_no_grad_trains():
    """Without ``torch.no_grad()`` every average keeps a graph; under it none does, and the loop trains quiet and bit
    for bit alike bare, watched and guarded (the shadows too)."""
    torch.manual_seed(0)
    assert hand_ema_loop(*plain_build())["graphs"] == len(list(tiny_unet().parameters()))
    assert three_runs(plain_build, lambda *a, guard=None: hand_ema_loop(*a, guard=guard, fix=True),
                      "always")["graphs"] == 0


@pytest.mark.parametrize("place", ["guard", "watch"])
def test_hand_made_ema_without_no_grad_is_warned(place):
    """The averages kept with their graphs: a ``GraphLeakWarning`` naming ``ema``. They reach no loss, and share
    nothing with the losses' graphs but the parameters' AccumulateGrad nodes: each is a tensor made again from its
    last value, whose graph grew since the last look (``leaks.Leaks._written_copies``)."""
    torch.manual_seed(0)
    built = plain_build()
    with pytest.warns(GraphLeakWarning, match=r"`(local )?ema(\[\d+\])?`"):
        if place == "watch":
            with Watch(GraphGuard(check="always"), __file__):
                hand_ema_loop(*built)
        else:
            hand_ema_loop(*built, guard=GraphGuard(built[0], check="always"))


def teacher_loop(model, data, guard=None, fix=None):
    """A consistency-distillation-like target: the UNet run on its own EMA weights (``functional_call(model, ema,
    ...)``, the teacher) gives the target, and the EMA is updated by hand after each update. The mistake: the
    target computed with its graph and the EMA updated without ``torch.no_grad()``, so each step's target
    back-propagates into the weights through every earlier average. ``fix``: ``"ema"``, the EMA updated under
    ``torch.no_grad()`` (what ``EMAModel.step`` does: the averages hold no graph); ``"both"``, the target under
    ``torch.no_grad()`` too (as diffusers' consistency distillation computes its target)."""
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward = backward_of(guard)
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    for _epoch in range(2):
        for clean_images in batches(data):
            with stepped(guard):
                noisy_images, noise, timesteps = noised(noise_scheduler, clean_images)
                with torch.no_grad() if fix == "both" else contextlib.nullcontext():
                    target = functional_call(model, ema, (noisy_images, timesteps)).sample
                loss = F.mse_loss(model(noisy_images, timesteps).sample, target)
                backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad() if fix else contextlib.nullcontext():
                    for name, p in model.named_parameters():
                        ema[name] = 0.9 * ema[name] + 0.1 * p
    return {"model": model, "optimizer": optimizer.state_dict(), "ema": ema}


@pytest.mark.parametrize("place", ["guard", "watch"])
def test_teacher_target_through_an_ema_kept_with_its_graph_is_stopped(place):
    """Step 2 may use the averages made in step 1 with their graph (a value made in the last step and used by this
    one only, as soft actor-critic's ``alpha``); step 3 reaches step 1's averages again: stopped before its
    backward (bare, PyTorch fails in it: "Trying to backward through the graph a second time"), naming an average
    (``ema['...']``) and advising to detach it at the end of each step; where a look at the leaks saw the averages'
    graph grow before (the guard's, not yet watch's at step 3), first to make the EMA's writes under
    ``torch.no_grad()`` (``fix="ema"``, which trains: below)."""
    torch.manual_seed(0)
    built = plain_build()
    pattern = r"step 3, .*held by `(local )?ema\['[\w.]+'\]`.*To fix: (make the writes that grew its graph under " \
              r"`torch\.no_grad\(\)`.*?an EMA's shadow copy.*?; or )?detach the carried state at the end of " \
              r"each step \(`ema\.update\(\{k: v\.detach\(\) for k, v in ema\.items\(\)\}\)`\)"
    with pytest.raises(CarriedGraphError, match=pattern):
        if place == "watch":
            with Watch(GraphGuard(check="always"), __file__):
                teacher_loop(*built)
        else:
            teacher_loop(*built, guard=GraphGuard(built[0], check="always"))
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        teacher_loop(*plain_build())


@pytest.mark.parametrize("fix", ["ema", "both"])
def test_teacher_target_with_the_ema_under_no_grad_trains(fix):
    """The EMA updated under ``torch.no_grad()`` (the target then has no graph either way): quiet, bit for bit
    alike bare, watched and guarded, and the same updates whether or not the target is under it too."""
    ref = three_runs(plain_build, lambda *a, guard=None: teacher_loop(*a, guard=guard, fix=fix), "always")
    assert all(e.grad_fn is None for e in ref["ema"].values())
    if fix == "ema":
        torch.manual_seed(0)
        built = plain_build()
        torch.manual_seed(1)
        same(teacher_loop(*built, fix="both"), ref)


def self_target_loop(model, data, guard=None):
    """The target of each step computed from the trained model with its graph in the same step (the prediction at
    the next timestep, ``model(noisy_images, timesteps + 1)``, without ``torch.no_grad()`` or ``.detach()``)."""
    noise_scheduler = DDPMScheduler(num_train_timesteps=TIMESTEPS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward = backward_of(guard)
    for clean_images in batches(data):
        with stepped(guard):
            noisy_images, noise, timesteps = noised(noise_scheduler, clean_images)
            target = model(noisy_images, timesteps + 1).sample
            loss = F.mse_loss(model(noisy_images, timesteps).sample, target)
            backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return {"model": model}


@pytest.mark.xfail(strict=True, reason="not a graph-lifecycle mistake: a target computed through the trained "
                   "weights in the same step is a valid graph, built and freed inside the step (a two-sided loss "
                   "does this on purpose); only the gradient's meaning is wrong, which no check of the guard reads")
def test_target_computed_from_the_model_in_the_step_is_warned():
    """The target with its graph: a warning naming ``target``."""
    torch.manual_seed(0)
    built = plain_build()
    with pytest.warns(GraphLifecycleWarning, match=r"`(local )?target`"):
        self_target_loop(*built, guard=GraphGuard(built[0], check="always"))
