# A top-k sparse autoencoder trained as openai/sparse_autoencoder's train.py writes it (training_loop_,
# FastAutoencoder, unit_norm_decoder_, unit_norm_decoder_grad_adjustment_, EmaModel), its Triton kernels written
# densely and without the CUDA GradScaler: the decoder initialized from the encoder through `.data`; after each
# backward the decoder's columns renormalized through `.data` and the gradient's component parallel to each column
# removed in place; gradients clipped with `_foreach_mul_`; the EMA weights moved by `torch._foreach_lerp_`. Two
# lines the source lacks: the EMA's step is under `torch.no_grad()` (the source's, outside it, grows a graph every
# step) and `opt.zero_grad()` follows the step (the source never clears the gradients); both mistakes are in
# tests/guard/test_weight_edits.py. Correct.
from contextlib import contextmanager

import torch
import torch.nn as nn


class FastAutoencoder(nn.Module):
    def __init__(self, n_dirs_local, d_model, k):
        super().__init__()
        self.k = k
        self.encoder = nn.Linear(d_model, n_dirs_local, bias=False)
        self.decoder = nn.Linear(n_dirs_local, d_model, bias=False)
        self.pre_bias = nn.Parameter(torch.zeros(d_model))
        self.latent_bias = nn.Parameter(torch.zeros(n_dirs_local))
        # "tied" init
        self.decoder.weight.data = self.encoder.weight.data.T.clone()
        # store decoder in column major layout for kernel
        self.decoder.weight.data = self.decoder.weight.data.T.contiguous().T
        unit_norm_decoder_(self)

    def forward(self, x):
        pre = self.encoder(x - self.pre_bias) + self.latent_bias
        vals, inds = torch.topk(pre, self.k, dim=-1)
        latents = torch.zeros_like(pre).scatter(-1, inds, torch.relu(vals))
        return self.decoder(latents) + self.pre_bias, dict(inds=inds, vals=vals)


def unit_norm_decoder_(autoencoder):
    autoencoder.decoder.weight.data /= autoencoder.decoder.weight.data.norm(dim=0)


def unit_norm_decoder_grad_adjustment_(autoencoder):
    """project out gradient information parallel to the dictionary vectors (the source's triton_add_mul_: grad += c * a * b)"""
    assert autoencoder.decoder.weight.grad is not None
    grad, weight = autoencoder.decoder.weight.grad, autoencoder.decoder.weight.data
    grad.add_(-1 * torch.einsum("bn,bn->n", weight, grad) * weight)


@contextmanager
def temporary_weight_swap(model, new_weights):
    for _p, new_p in zip(model.parameters(), new_weights, strict=True):
        _p.data, new_p.data = new_p.data, _p.data
    yield
    for _p, new_p in zip(model.parameters(), new_weights, strict=True):
        _p.data, new_p.data = new_p.data, _p.data


class EmaModel:
    def __init__(self, model, ema_multiplier):
        self.model = model
        self.ema_multiplier = ema_multiplier
        self.ema_weights = [torch.zeros_like(x, requires_grad=False) for x in model.parameters()]
        self.ema_steps = 0

    def step(self):
        torch._foreach_lerp_(self.ema_weights, list(self.model.parameters()), 1 - self.ema_multiplier)
        self.ema_steps += 1

    @contextmanager
    def use_ema_weights(self):
        bias_correction = 1 - self.ema_multiplier ** self.ema_steps
        ema_weights_bias_corrected = torch._foreach_div(self.ema_weights, bias_correction)
        with torch.no_grad():
            with temporary_weight_swap(self.model, ema_weights_bias_corrected):
                yield


def normalized_mse(recon, xs):
    return (((recon - xs) ** 2).mean(dim=1) / (xs ** 2).mean(dim=1)).mean()


def training_loop_(ae, train_acts_iter, loss_fn, lr, eps=6.25e-10, clip_grad=1.0, ema_multiplier=0.9):
    opt = torch.optim.Adam(ae.parameters(), lr=lr, eps=eps)
    ema = EmaModel(ae, ema_multiplier=ema_multiplier)
    for i, flat_acts_train_batch in enumerate(train_acts_iter):
        recons, info = ae(flat_acts_train_batch)
        loss = loss_fn(ae, flat_acts_train_batch, recons, info)
        print(i, repr(loss.item()))
        loss.backward()
        unit_norm_decoder_(ae)
        unit_norm_decoder_grad_adjustment_(ae)
        if clip_grad is not None:
            grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in ae.parameters() if p.grad is not None))
            grads = [x.grad for x in ae.parameters() if x.grad is not None]
            torch._foreach_mul_(grads, clip_grad / torch.clamp(grad_norm, min=clip_grad))
        with torch.no_grad():
            ema.step()
        opt.step()
        opt.zero_grad()
    return ema


torch.manual_seed(0)
ae = FastAutoencoder(n_dirs_local=16, d_model=6, k=3)
batches = [torch.randn(10, 6) for _ in range(8)]
ema = training_loop_(ae, iter(batches), lambda ae, x, recons, info: normalized_mse(recons, x), lr=1e-2)
with ema.use_ema_weights():
    print("ema loss", repr(normalized_mse(ae(batches[0])[0], batches[0]).item()))
print(repr(sum(p.detach().double().pow(2).sum().item() for p in ae.parameters())))
