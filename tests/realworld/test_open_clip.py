"""CLIP training with cached-feature gradient accumulation: mlfoundations/open_clip at commit
698f8cc7a9075b9019168ce0940a38cee604a871, src/training/train.py (``train_one_epoch``, ``backward``),
src/training/main.py (the optimizer), src/training/scheduler.py (``cosine_lr``), src/open_clip/model.py
(``CLIP.encode_image``, ``encode_text``, ``forward`` with ``output_dict``) and src/open_clip/loss.py
(``ClipLoss``).

With ``accum_freq`` > 1 every batch is first encoded under ``no_grad`` and its features cached; at every
``accum_freq``-th batch each cached batch is encoded again with gradient, its features spliced into the
cached ones (``torch.cat(accumulated[:j] + [model_out[key]] + accumulated[j + 1:])``) so that the other
batches serve as negatives, and the symmetric contrastive loss over all of them is back-propagated, one
``backward`` per batch into the same ``.grad``, with no division; then ``clip_grad_norm_`` and one AdamW step
in two groups (no decay on gains, biases and ``logit_scale``), the learning rate assigned per step by
``cosine_lr`` (called at every batch, with the accumulated step's index), and ``logit_scale`` clamped in place
to ``ln 100`` under ``no_grad`` after the update. ``logit_scale.exp()`` multiplies the logits.

Changes for a seconds-long test: a flattened-image MLP with a LayerNorm (a ViT) and a one-layer text tower
(a transformer; token and positional embeddings, ``ln_final``, argmax pooling and ``text_projection`` kept),
8-dim embeddings, 4 batches of 4 pairs per epoch, 2 epochs, ``accum_freq`` 2; single process; no autocast, no
GradScaler. On random pairs ``logit_scale`` falls, so the clamp changes no value here: it still writes the
parameter in place after every update (its version moves).

The port is manual: its data yields each step's ``accum_freq`` batches together; ``training_step`` caches,
re-encodes and calls ``self.backward`` per batch, then ``self.step()`` (``grad_clip``) and the clamp.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare

ACCUM_FREQ, PER_EPOCH, EPOCHS, BATCH, VOCAB, CTX, WIDTH, EMBED = 2, 4, 2, 4, 20, 5, 8, 8
LR, WD, WARMUP, GRAD_CLIP_NORM = 5e-2, 0.2, 1, 1.0


# -- src/open_clip/model.py ---------------------------------------------------------------------------------
class CLIP(nn.Module):
    def __init__(self, init_logit_scale: float = np.log(1 / 0.07)):
        super().__init__()
        self.output_dict = True
        self.visual = nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, EMBED))
        self.token_embedding = nn.Embedding(VOCAB, WIDTH)
        self.positional_embedding = nn.Parameter(torch.empty(CTX, WIDTH))
        self.transformer = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.ln_final = nn.LayerNorm(WIDTH)
        self.text_projection = nn.Parameter(torch.empty(WIDTH, EMBED))
        self.logit_scale = nn.Parameter(torch.ones([]) * init_logit_scale)
        self.logit_bias = None
        nn.init.normal_(self.positional_embedding, std=0.01)
        nn.init.normal_(self.text_projection, std=WIDTH ** -0.5)

    def encode_image(self, image, normalize: bool = False):
        features = self.visual(image)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text, normalize: bool = False):
        x = self.token_embedding(text)  # [batch_size, n_ctx, d_model]

        x = x + self.positional_embedding
        x = self.transformer(x)
        x = self.ln_final(x)  # [batch_size, n_ctx, transformer.width]
        x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)]  # text_global_pool(x, text, 'argmax')
        x = x @ self.text_projection

        return F.normalize(x, dim=-1) if normalize else x

    def forward(self, image=None, text=None):
        image_features = self.encode_image(image, normalize=True) if image is not None else None
        text_features = self.encode_text(text, normalize=True) if text is not None else None

        if self.output_dict:
            out_dict = {
                "image_features": image_features,
                "text_features": text_features,
                "logit_scale": self.logit_scale.exp()
            }
            if self.logit_bias is not None:
                out_dict['logit_bias'] = self.logit_bias
            return out_dict
        return image_features, text_features, self.logit_scale.exp()


# -- src/open_clip/loss.py (world_size 1) -------------------------------------------------------------------
class ClipLoss(nn.Module):
    def __init__(self, cache_labels=False):
        super().__init__()
        self.cache_labels = cache_labels
        self.prev_num_logits = 0
        self.labels = {}

    def get_ground_truth(self, device, num_logits) -> torch.Tensor:
        if self.prev_num_logits != num_logits or device not in self.labels:
            labels = torch.arange(num_logits, device=device, dtype=torch.long)
            if self.cache_labels:
                self.labels[device] = labels
                self.prev_num_logits = num_logits
        else:
            labels = self.labels[device]
        return labels

    def get_logits(self, image_features, text_features, logit_scale):
        logits_per_image = logit_scale * image_features @ text_features.T
        logits_per_text = logit_scale * text_features @ image_features.T
        return logits_per_image, logits_per_text

    def forward(self, image_features, text_features, logit_scale, output_dict=False):
        device = image_features.device
        logits_per_image, logits_per_text = self.get_logits(image_features, text_features, logit_scale)

        labels = self.get_ground_truth(device, logits_per_image.shape[0])

        total_loss = (
            F.cross_entropy(logits_per_image, labels) +
            F.cross_entropy(logits_per_text, labels)
        ) / 2

        return {"contrastive_loss": total_loss} if output_dict else total_loss


# -- src/training/scheduler.py ------------------------------------------------------------------------------
def assign_learning_rate(optimizer, new_lr):
    for param_group in optimizer.param_groups:
        param_group["lr"] = new_lr


def _warmup_lr(base_lr, warmup_length, step):
    return base_lr * (step + 1) / warmup_length


def cosine_lr(optimizer, base_lr, warmup_length, steps):
    def _lr_adjuster(step):
        if step < warmup_length:
            lr = _warmup_lr(base_lr, warmup_length, step)
        else:
            e = step - warmup_length
            es = steps - warmup_length
            lr = 0.5 * (1 + np.cos(np.pi * e / es)) * base_lr
        assign_learning_rate(optimizer, lr)
        return lr
    return _lr_adjuster


# -- src/training/main.py -----------------------------------------------------------------------------------
def make_optimizer(model):
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or 'logit_scale' in n
    include = lambda n, p: not exclude(n, p)

    named_parameters = list(model.named_parameters())
    gain_or_bias_params = [p for n, p in named_parameters if exclude(n, p) and p.requires_grad]
    rest_params = [p for n, p in named_parameters if include(n, p) and p.requires_grad]

    optimizer = torch.optim.AdamW(
        [
            {"params": gain_or_bias_params, "weight_decay": 0.},
            {"params": rest_params, "weight_decay": WD},
        ],
        lr=LR,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    scheduler = cosine_lr(optimizer, LR, WARMUP, PER_EPOCH // ACCUM_FREQ * EPOCHS)
    return optimizer, scheduler


# -- src/training/train.py ----------------------------------------------------------------------------------
def backward(total_loss, scaler):
    if scaler is not None:
        scaler.scale(total_loss).backward()
    else:
        total_loss.backward()


def train_one_epoch(model, dataloader, loss, epoch, optimizer, scaler, scheduler):
    model.train()
    num_batches_per_epoch = len(dataloader) // ACCUM_FREQ
    if ACCUM_FREQ > 1:
        accum_images, accum_texts, accum_features = [], [], {}
    for i, batch in enumerate(dataloader):
        i_accum = i // ACCUM_FREQ
        step = num_batches_per_epoch * epoch + i_accum
        scheduler(step)

        images, texts = batch
        optimizer.zero_grad()

        # First, cache the features without any gradient tracking.
        with torch.no_grad():
            model_out = model(images, texts)

            for f in ("logit_scale", "logit_bias"):
                model_out.pop(f, None)

            for key, val in model_out.items():
                if key in accum_features:
                    accum_features[key].append(val)
                else:
                    accum_features[key] = [val]

            accum_images.append(images)
            accum_texts.append(texts)

        # If (i + 1) % accum_freq is not zero, move on to the next batch.
        if ((i + 1) % ACCUM_FREQ) > 0:
            continue

        optimizer.zero_grad()
        for j in range(ACCUM_FREQ):
            images = accum_images[j]
            texts = accum_texts[j]
            model_out = model(images, texts)

            inputs_no_accum = {}
            inputs_no_accum["logit_scale"] = logit_scale = model_out.pop("logit_scale")
            if "logit_bias" in model_out:
                inputs_no_accum["logit_bias"] = model_out.pop("logit_bias")

            inputs = {}
            for key, val in accum_features.items():
                accumulated = accum_features[key]
                inputs[key] = torch.cat(accumulated[:j] + [model_out[key]] + accumulated[j + 1:])

            losses = loss(**inputs, **inputs_no_accum, output_dict=True)
            del inputs
            del inputs_no_accum
            total_loss = sum(losses.values())
            losses["loss"] = total_loss

            backward(total_loss, scaler)

        if GRAD_CLIP_NORM is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP_NORM, norm_type=2.0)
        optimizer.step()

        # reset gradient accum, if enabled
        if ACCUM_FREQ > 1:
            accum_images, accum_texts, accum_features = [], [], {}

        # Note: we clamp to 4.6052 = ln(100), as in the original paper.
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))


def clip_hand(model, data):
    optimizer, scheduler = make_optimizer(model)
    loss = ClipLoss()
    for epoch in range(EPOCHS):
        train_one_epoch(model, data, loss, epoch, optimizer, None, scheduler)


class ClipTrainer(Trainer):
    automatic = False

    def __init__(self, train_data, **kwargs):
        super().__init__(train_data=train_data.accumulated(), **kwargs)

    def configure_optimizers(self):
        optimizer, self.scheduler = make_optimizer(self.model)
        self.loss, self.accum_step = ClipLoss(), -1
        return optimizer

    def training_step(self, accum_batches):
        model = self.model
        self.accum_step += 1
        self.scheduler(self.accum_step)
        accum_features = {}
        with torch.no_grad():
            for images, texts in accum_batches:
                model_out = model(images, texts)
                for f in ("logit_scale", "logit_bias"):
                    model_out.pop(f, None)
                for key, val in model_out.items():
                    accum_features.setdefault(key, []).append(val)
        for j, (images, texts) in enumerate(accum_batches):
            model_out = model(images, texts)
            inputs_no_accum = {"logit_scale": model_out.pop("logit_scale")}
            inputs = {key: torch.cat(acc[:j] + [model_out[key]] + acc[j + 1:]) for key, acc in accum_features.items()}
            total_loss = sum(self.loss(**inputs, **inputs_no_accum, output_dict=True).values())
            self.backward(total_loss)
        self.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        return total_loss


class Pairs(list):
    """Image-text batches; ``accumulated`` groups them ``ACCUM_FREQ`` a step, for the port."""

    def __init__(self):
        gen = torch.Generator().manual_seed(6)
        super().__init__((torch.randn(BATCH, 3, 4, 4, generator=gen), torch.randint(VOCAB, (BATCH, CTX), generator=gen))
                         for _ in range(PER_EPOCH))

    def accumulated(self):
        return [self[i:i + ACCUM_FREQ] for i in range(0, len(self), ACCUM_FREQ)]


@pytest.mark.parametrize("check", checks())
def test_open_clip_with_cached_feature_accumulation_and_a_clamped_logit_scale(check):
    compare(CLIP, clip_hand, ClipTrainer, lambda model: Pairs(), check, steps=EPOCHS * PER_EPOCH // ACCUM_FREQ,
            max_epochs=EPOCHS, grad_clip=GRAD_CLIP_NORM)
