"""Loops that optimize an input or a latent rather than (or beside) a model's weights, under ``GraphGuard`` through
``Watch`` in process, as ``python -m safeloop.watch`` runs them: VQGAN+CLIP's latent ``z`` (nerdyrodent/VQGAN-CLIP,
generate.py: a leaf Adam updates, clamped in place after each step, prompts embedded once before the loop by a frozen
perceptor); the watch scripts ``vqgan_clip_*``, ``dip_*`` and ``sds_*`` run such loops as their sources write them.
Each fix a message gives is applied as written and must train bit for bit as the correct loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import CarriedGraphError, DoubleBackwardError, GraphGuard, GraphReuseError, NoGraphError
from safeloop.watch import Watch
from tests.guard.runs import watched


class ReplaceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_forward, x_backward):
        ctx.shape = x_backward.shape
        return x_forward

    @staticmethod
    def backward(ctx, grad_in):
        return None, grad_in.sum_to_size(ctx.shape)


class ClampWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, min, max):
        ctx.min, ctx.max = min, max
        ctx.save_for_backward(input)
        return input.clamp(min, max)

    @staticmethod
    def backward(ctx, grad_in):
        input, = ctx.saved_tensors
        return grad_in * (grad_in * (input - input.clamp(ctx.min, ctx.max)) >= 0), None, None


class Prompt(nn.Module):
    def __init__(self, embed, weight=1.):
        super().__init__()
        self.register_buffer('embed', embed)
        self.register_buffer('weight', torch.as_tensor(weight))

    def forward(self, input):
        input_normed = F.normalize(input.unsqueeze(1), dim=2)
        embed_normed = F.normalize(self.embed.unsqueeze(0), dim=2)
        dists = input_normed.sub(embed_normed).norm(dim=2).div(2).arcsin().pow(2).mul(2)
        return self.weight.abs() * dists.mean()


def vqgan_clip(clamp: str = "in place", frozen: bool = True, embed_fix: bool = False):
    """generate.py's loop, shrunk: ``clamp`` says how ``z`` is clamped after each step: "in place" (``z.copy_`` under
    ``torch.inference_mode()``, as the source), "rebound" (``z = z.clamp(...)`` with grad on), "rebound under
    no_grad", or "fixed" (the first fix of "rebound" as its message writes it); ``frozen``: the perceptor made
    ``requires_grad_(False)`` as the source does; ``embed_fix``: the prompt's embedding stored detached."""
    torch.manual_seed(0)
    codebook = nn.Embedding(16, 4).requires_grad_(False)
    decoder = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(4, 3, 3, padding=1)).requires_grad_(False)
    token_embedding = nn.Embedding(32, 8).requires_grad_(not frozen)
    visual = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 8))
    visual.requires_grad_(not frozen)
    z_min = codebook.weight.min(dim=0).values[None, :, None, None]
    z_max = codebook.weight.max(dim=0).values[None, :, None, None]
    z = (F.one_hot(torch.randint(16, [16]), 16).float() @ codebook.weight).view([-1, 4, 4, 4]).permute(0, 3, 1, 2)
    z.requires_grad_(True)
    pMs = []
    for txt, weight in [(torch.tensor([[1, 5, 7]]), 1.), (torch.tensor([[2, 9]]), 0.5)]:
        embed = token_embedding(txt).mean(1).float()
        pMs.append(Prompt(embed.detach() if embed_fix else embed, weight))
    opt = torch.optim.Adam([z], lr=0.1)
    losses = []
    for i in range(5):
        opt.zero_grad(set_to_none=True)
        x = z.movedim(1, 3)
        d = x.pow(2).sum(dim=-1, keepdim=True) + codebook.weight.pow(2).sum(dim=1) - 2 * x @ codebook.weight.T
        z_q = ReplaceGrad.apply(F.one_hot(d.argmin(-1), 16).to(d.dtype) @ codebook.weight, x).movedim(3, 1)
        out = ClampWithGrad.apply(torch.tanh(decoder(z_q)).add(1).div(2), 0, 1)
        iii = visual(out)
        loss = sum(prompt(iii) for prompt in pMs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if clamp == "in place":
            with torch.inference_mode():
                z.copy_(z.maximum(z_min).minimum(z_max))
        elif clamp == "rebound":
            z = z.maximum(z_min).minimum(z_max)
        elif clamp == "rebound under no_grad":
            with torch.no_grad():
                z = z.maximum(z_min).minimum(z_max)
        else:
            with torch.no_grad(): z.copy_(z.maximum(z_min).minimum(z_max))  # noqa: E701 (the fix as written)
    return losses, opt.param_groups[0]["params"][0].detach().clone()


def same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_a_latent_clamped_in_place_after_each_step_trains_as_without_the_guard(check):
    assert same(watched(vqgan_clip, check), vqgan_clip())


def test_a_latent_clamped_out_of_place_is_told_to_be_written_into_in_place_not_detached():
    """``z = z.clamp(...)`` rebinds ``z`` to a value made from the optimizer's leaf: Adam keeps updating the old leaf,
    each step back-propagates through the clamps of all the steps before it (the third fails in PyTorch). Detaching
    ``z`` would leave the loss without a graph; the fix writes the clamp into the leaf."""
    with pytest.raises(CarriedGraphError, match=r"held by `local z`.*To fix: write the new value into `z` in place "
                                                r"under `torch.no_grad\(\)` \(`with torch.no_grad\(\): z.copy_\(...\)`"):
        watched(vqgan_clip, "always", clamp="rebound")
    for check in ("always", "off"):
        assert same(watched(vqgan_clip, check, clamp="fixed"), vqgan_clip())


def test_a_latent_clamped_out_of_place_under_no_grad_is_told_the_optimizer_lost_it():
    with pytest.raises(NoGraphError, match=r"step 2.*To fix: write the new value into `z` in place"):
        watched(vqgan_clip, "always", clamp="rebound under no_grad")


def test_prompt_embeddings_of_a_perceptor_left_trainable_are_told_to_be_stored_detached():
    """generate.py's perceptor without ``requires_grad_(False)``: each prompt's embedding keeps the graph of the
    text encoder, built before the loop; the second step would fail. Stored detached, the latent trains as with the
    frozen perceptor (the image encoder's gradients, which no optimizer holds, go nowhere)."""
    with pytest.raises(GraphReuseError, match=r"step 1.*held by `local embed`.*To fix: if it is meant as a constant .*"
                                              r"store `embed.detach\(\)` instead"):
        watched(vqgan_clip, "always", frozen=False)
    for check in ("always", "off"):
        assert same(watched(vqgan_clip, check, frozen=False, embed_fix=True), vqgan_clip())


class SpecifyGradient(torch.autograd.Function):
    """stable-dreamfusion's (nerf/sd.py after commit 28bd8ee): a dummy loss whose backward gives ``gt_grad``."""

    @staticmethod
    def forward(ctx, input_tensor, gt_grad):
        ctx.save_for_backward(gt_grad)
        return torch.zeros([1], device=input_tensor.device, dtype=input_tensor.dtype)

    @staticmethod
    def backward(ctx, grad):
        gt_grad, = ctx.saved_tensors
        return gt_grad / len(gt_grad), None


def sds(mode: str = "retained"):
    """Score distillation as stable-dreamfusion's train_step writes it, shrunk (the watch script
    ``sds_latents_backward_retained`` is the whole loop): the guidance's gradient given to the rendered image's
    latents by hand, then the regularizers on the same render back-propagated. ``mode``: "retained" (the source
    before 28bd8ee: ``latents.backward(gradient=grad, retain_graph=True)``, dummy loss 0), "not retained" (the same
    without retain_graph), "fixed" (that one's first fix as its message writes it), "specified" (the source after
    28bd8ee: ``SpecifyGradient``, one backward), "target" (the source today: an MSE to ``(latents - grad).detach()``)."""
    torch.manual_seed(0)
    field = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 4))
    vae = nn.Conv2d(3, 4, 2, stride=2).requires_grad_(False)
    unet = nn.Conv2d(4, 4, 3, padding=1).requires_grad_(False)
    optimizer = torch.optim.Adam(field.parameters(), lr=1e-2)
    for _ in range(3):
        rays = torch.randn(1, 64, 3)
        optimizer.zero_grad()
        out = field(rays)
        pred_rgb = torch.sigmoid(out[..., :3]).reshape(1, 8, 8, 3).permute(0, 3, 1, 2).contiguous()
        latents = vae(2 * pred_rgb - 1)
        with torch.no_grad():
            noise = torch.randn_like(latents)
            noise_pred = unet(0.7 * latents + 0.3 * noise)
        grad = torch.nan_to_num(0.5 * (noise_pred - noise))
        if mode == "retained":
            latents.backward(gradient=grad, retain_graph=True)
            loss = 0
        elif mode == "not retained":
            latents.backward(gradient=grad)
            loss = 0
        elif mode == "fixed":
            latents.backward(gradient=grad, retain_graph=True)  # the first fix as written
            loss = 0
        elif mode == "specified":
            loss = SpecifyGradient.apply(latents, grad)
        else:
            targets = (latents - grad).detach()
            loss = 0.5 * F.mse_loss(latents.float(), targets, reduction='sum') / latents.shape[0]
        pred_ws = torch.sigmoid(out[..., 3]).reshape(1, 1, 8, 8)
        loss = loss + 1e-3 * (pred_ws ** 2).mean()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in field.parameters()]


@pytest.mark.parametrize("mode", ["retained", "specified", "target"])
@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_score_distillation_written_each_way_trains_as_without_the_guard(mode, check):
    assert all(torch.equal(p, q) for p, q in zip(watched(sds, check, mode=mode), sds(mode), strict=True))


def test_a_hand_given_gradient_not_retained_is_told_to_retain_in_that_call_itself():
    """The regularizers' backward goes through the render that ``latents.backward(gradient=grad)`` freed: the fix
    names that call with retain_graph=True added, as it is written, and so applied trains as the source."""
    with pytest.raises(DoubleBackwardError, match=r"To fix: pass retain_graph=True to the backward of 'loss' at "
                                                  r"test_input_optimization.py:\d+ \(latents.backward\(gradient=grad, "
                                                  r"retain_graph=True\)\)"):
        watched(sds, "always", mode="not retained")
    source = sds()
    for check in ("always", "off"):
        assert all(torch.equal(p, q) for p, q in zip(watched(sds, check, mode="fixed"), source, strict=True))


def deep_image_prior(optimizer_type: str = "adam", out_avg_fix: bool = True, opt_over: str = "net",
                     reg_noise_std: float = 1. / 30.):
    """denoising.ipynb's closure and utils/common_utils.py's ``optimize`` (DmitryUlyanov/deep-image-prior), shrunk;
    the watch scripts ``dip_denoising_*`` run it at module level. ``optimizer_type`` "LBFGS": a few Adam steps, then
    L-BFGS calling the closure through ``closure2``, as ``optimize`` does; ``out_avg_fix``: the average made from
    ``out.detach()`` as the source (else from ``out``, as ``out_avg = out_avg.detach()`` after it fixes it, applied as
    the leak's message writes it); ``opt_over``: get_params' choice ("net,input" also optimizes the input)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(8, 3, 3, padding=1), nn.Sigmoid())
    mse = torch.nn.MSELoss()
    img_noisy_torch = torch.rand(1, 3, 8, 8)
    net_input = (torch.rand(1, 4, 8, 8) * 0.1).detach()
    net_input_saved = net_input.detach().clone()
    noise = net_input.detach().clone()
    state = {"out_avg": None}
    losses = []

    def closure():
        nonlocal net_input
        if reg_noise_std > 0:
            net_input = net_input_saved + (noise.normal_() * reg_noise_std)
        out = net(net_input)
        if state["out_avg"] is None:
            state["out_avg"] = out.detach()
        elif out_avg_fix:
            state["out_avg"] = state["out_avg"] * 0.99 + out.detach() * (1 - 0.99)
        else:
            out_avg = state["out_avg"] * 0.99 + out * (1 - 0.99)
            out_avg = out_avg.detach()
            state["out_avg"] = out_avg
        total_loss = mse(out, img_noisy_torch)
        total_loss.backward()
        losses.append(total_loss.item())
        return total_loss

    params = [x for x in net.parameters()]
    if "input" in opt_over:
        net_input.requires_grad = True
        params += [net_input]
    optimizer = torch.optim.Adam(params, lr=0.01)
    for j in range(4):
        optimizer.zero_grad()
        closure()
        optimizer.step()
    if optimizer_type == "LBFGS":
        def closure2():
            optimizer.zero_grad()
            return closure()
        optimizer = torch.optim.LBFGS(params, max_iter=4, lr=0.1, tolerance_grad=-1, tolerance_change=-1)
        optimizer.step(closure2)
    return losses, [p.detach().clone() for p in params]


def same_run(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("optimizer_type", ["adam", "LBFGS"])
@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_deep_image_prior_trains_as_without_the_guard(optimizer_type, check):
    assert same_run(watched(deep_image_prior, check, optimizer_type=optimizer_type), deep_image_prior(optimizer_type))


def test_deep_image_prior_average_detached_as_its_leak_says_trains_as_the_source():
    for check in ("always", "off"):
        assert same_run(watched(deep_image_prior, check, out_avg_fix=False), deep_image_prior())


@pytest.mark.xfail(strict=True, reason="get_params('net,input') makes the input a leaf the optimizer holds, but the "
                   "closure rebinds `net_input` to `net_input_saved + noise` every step: no loss reaches that leaf, "
                   "which never trains. The guard looks for gradients no optimizer uses, not for an optimizer's "
                   "tensor that no loss reaches and no variable holds any more: nothing is said")
def test_an_optimized_input_rebound_by_the_closure_is_said_to_go_untrained():
    with pytest.raises(Warning, match=r"`net_input`"):
        watched(deep_image_prior, "always", opt_over="net,input")


def uap_sgd(detach: bool):
    """kenny-co/sgd-uap-torch's attacks.py ``uap_sgd`` (a universal perturbation: the batch's copies of ``delta`` a
    leaf whose ``.data`` is set every iteration, its gradient's sign averaged into ``delta`` by hand, no optimizer),
    shrunk, with the source's ``losses.append(torch.mean(loss))``, which keeps every iteration's graph
    (``detach``: as the leak's message says to write it). The first ``batch_delta.grad.data.zero_()`` of each
    iteration, which fails on the first (no gradient yet), is left out: the last line of the iteration does it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5))
    loader = [(torch.rand(4, 3, 2, 2), torch.randint(5, (4,))) for _ in range(3)]
    eps, eps_step = 0.1, 0.08
    batch_delta = torch.zeros_like(loader[0][0])
    delta = batch_delta[0]
    losses = []
    loss_fn = nn.CrossEntropyLoss(reduction='none')
    beta = torch.FloatTensor([12])
    batch_delta.requires_grad_()
    for epoch in range(2):
        for i, (x_val, y_val) in enumerate(loader):
            batch_delta.data = delta.unsqueeze(0).repeat([x_val.shape[0], 1, 1, 1])
            perturbed = torch.clamp((x_val + batch_delta), 0, 1)
            outputs = model(perturbed)
            loss = torch.mean(torch.min(loss_fn(outputs, y_val), beta))
            losses.append(torch.mean(loss).detach() if detach else torch.mean(loss))
            loss.backward()
            grad_sign = batch_delta.grad.data.mean(dim=0).sign()
            delta = delta + grad_sign * eps_step
            delta = torch.clamp(delta, -eps, eps)
            batch_delta.grad.data.zero_()
    return [loss.item() for loss in losses], [delta.detach().clone()]


def test_a_universal_perturbations_kept_losses_are_named_and_detached_where_added():
    with Watch(GraphGuard(check="always"), __file__), pytest.warns(Warning, match=r"held by `local losses\[0\]`.*To "
                                                                   r"fix: detach what is added to `losses`"):
        kept = uap_sgd(False)
    assert same_run(kept, uap_sgd(False))
    for check in ("always", "auto", "off"):
        assert same_run(watched(uap_sgd, check, detach=True), uap_sgd(False))
