"""Bilevel loops with a ``GraphGuard``: dataset condensation by gradient matching (VICO-UoE/DatasetCondensation,
main.py and utils.py), dataset distillation by matching training trajectories with a learnable learning rate
(GeorgeCazenavette/mtt-distillation, distill.py) and hyperparameters learned by hypergradient descent
(kach/gradient-descent-the-ultimate-optimizer, gdtuo.py); the same loops run under ``watch`` in
``tests/watch/scripts/dc_gradient_matching.py``, ``mtt_trajectory_matching.py`` and ``gdtuo_hyperoptimized_adam.py``.
Each correct loop trains bit for bit as without the guard and says nothing; each mistake is told with its tensor and a
fix that trains as the correct loop."""
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import CarriedGraphError, GraphGuard, NoGraphError, UnusedGradientWarning
from tests.conftest import subprocess_env

MODES = ["always", "auto", "off"]


def _net():
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 2))


def _distance(gwr, gws):
    """``distance_wb``: one minus the cosine of each output's gradients, summed; nothing for a bias."""
    if gwr.dim() == 1:
        return torch.tensor(0, dtype=torch.float)
    gwr, gws = gwr.reshape(gwr.shape[0], -1), gws.reshape(gws.shape[0], -1)
    return torch.sum(1 - torch.sum(gwr * gws, dim=-1) / (torch.norm(gwr, dim=-1) * torch.norm(gws, dim=-1) + 1e-6))


def condense(check: str | None, mistake: str | None = None) -> torch.Tensor:
    """Three iterations of gradient matching, two outer steps each (the network trained on a detached copy of the
    synthetic images in between). ``mistake``: "sum kept" (the matching loss started once per iteration, not once
    per outer step), "sum kept, reset" (the same, with ``loss = 0`` after each backward's ``loss.item()``),
    "no create_graph" (the synthetic side's gradient taken without ``create_graph=True``), "real with graph" (the real
    side's with ``create_graph=True`` and not detached)."""
    torch.manual_seed(0)
    real = torch.randn(16, 1, 4, 4)
    image_syn = torch.randn(4, 1, 4, 4, requires_grad=True)
    optimizer_img = torch.optim.SGD([image_syn], lr=0.1, momentum=0.5)
    guard = GraphGuard(optimizers=optimizer_img, check=check) if check else None
    step = guard.step if guard else torch.enable_grad
    for it in range(3):
        net = _net()
        net_parameters = list(net.parameters())
        optimizer_net = torch.optim.SGD(net.parameters(), lr=0.01)
        if mistake and mistake.startswith("sum kept"):
            loss = torch.tensor(0.0)
        for ol in range(2):
            with step():
                if not (mistake and mistake.startswith("sum kept")):
                    loss = torch.tensor(0.0)
                for c in range(2):
                    img_real = real[torch.randperm(16)[:4]]
                    lab = torch.full((4,), c)
                    gw_real = torch.autograd.grad(F.cross_entropy(net(img_real), lab), net_parameters,
                                                  create_graph=mistake == "real with graph")
                    if mistake != "real with graph":
                        gw_real = [g.detach().clone() for g in gw_real]
                    out_syn = net(image_syn[c * 2:(c + 1) * 2])
                    gw_syn = torch.autograd.grad(F.cross_entropy(out_syn, lab[:2]), net_parameters,
                                                 create_graph=mistake != "no create_graph")
                    loss += sum(_distance(r, s) for r, s in zip(gw_real, gw_syn))
                optimizer_img.zero_grad()
                guard.backward(loss) if guard else loss.backward()
                optimizer_img.step()
                loss.item()
                if mistake == "sum kept, reset":
                    loss = 0
            if ol == 1:
                break
            syn = image_syn.detach().clone()
            for i in torch.randperm(4).split(2):
                with step():
                    out = net(syn[i])
                    optimizer_net.zero_grad()
                    inner = F.cross_entropy(out, torch.div(i, 2, rounding_mode="floor"))
                    guard.backward(inner) if guard else inner.backward()
                    optimizer_net.step()
    return image_syn.detach().clone()


@pytest.mark.parametrize("check", MODES)
def test_gradient_matching_is_quiet_and_trains_as_without_the_guard(check):
    bare = condense(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(condense(check), bare)
        # the real side's gradient taken with a graph and not detached: a waste, the same update
        assert torch.equal(condense(check, "real with graph"), bare)


def test_a_matching_loss_summed_across_outer_steps_is_told_to_start_again_and_that_fix_trains_the_same():
    with pytest.raises(CarriedGraphError, match=r"\(step 4, loss 'loss'\).*held by `local loss`.*To fix: start the sum "
                                                r"again after each backward \(`loss = 0`\)"):
        condense("always", "sum kept")
    assert torch.equal(condense("always", "sum kept, reset"), condense(None))


@pytest.mark.xfail(strict=True, reason="a GraphGuard does not see the loop's torch.autograd.grad calls (watch does: "
                   "the test below), so a loss with no graph is told first to be computed from the model's output with "
                   "grad enabled; create_graph=True comes second, for a penalty on gradients")
def test_a_synthetic_gradient_taken_without_create_graph_is_told_to_pass_it_first():
    with pytest.raises(NoGraphError, match=r"To fix: if the loss is made of the gradients .*pass create_graph=True"):
        condense("always", "no create_graph")


def test_under_watch_a_synthetic_gradient_taken_without_create_graph_is_told_to_pass_it_to_that_call(tmp_path):
    """Under watch the step's torch.autograd.grad of the parameters without create_graph=True is known: the fix names
    that call's line (the synthetic side's, the last of the step), and applied there it is the correct script."""
    source = (Path(__file__).parents[1] / "watch" / "scripts" / "dc_gradient_matching.py").read_text()
    right = "gw_syn = torch.autograd.grad(loss_syn, net_parameters, create_graph=True)"
    script = tmp_path / "dc.py"
    script.write_text(source.replace(right, "gw_syn = torch.autograd.grad(loss_syn, net_parameters)"))
    line = source[:source.index(right)].count("\n") + 1
    proc = subprocess.run([sys.executable, "-m", "safeloop.watch", str(script)], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("safeloop.errors.NoGraphError"), proc.stderr[-2000:]
    assert f"To fix: if the loss is made of the gradients that the torch.autograd.grad of 'loss' at dc.py:{line} " \
           "returned (a matched gradient, a gradient penalty), pass create_graph=True to it" in last, last


def distill(check: str | None, mistake: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Four iterations of trajectory matching: a flat student unrolled three steps from an expert's checkpoint by
    ``student_params[-1] - syn_lr * grad``, its distance to a later checkpoint training the synthetic images and
    ``syn_lr``, each with its own optimizer. ``mistake``: "no create_graph" (each inner gradient without
    ``create_graph=True``: the images get no gradient), "lr item" (``syn_lr.item()`` in the unrolled step: the
    learning rate gets none), "lr replaced" (the learning rate made a leaf that requires grad after its optimizer was
    built on the tensor before: the optimizer's never gets a gradient, the new one's goes nowhere)."""
    torch.manual_seed(0)
    net = _net()
    shapes = [p.shape for p in net.parameters()]
    expert = [torch.cat([p.detach().reshape(-1) for p in net.parameters()])]
    for _ in range(3):
        expert.append(expert[-1] + 0.05 * torch.randn_like(expert[-1]))
    image_syn = torch.randn(4, 1, 4, 4).requires_grad_(True)
    syn_lr = torch.tensor(0.01) if mistake == "lr replaced" else torch.tensor(0.01).requires_grad_(True)
    label_syn = torch.tensor([0, 0, 1, 1])
    optimizer_img = torch.optim.SGD([image_syn], lr=100, momentum=0.5)
    optimizer_lr = torch.optim.SGD([syn_lr], lr=1e-3, momentum=0.5)
    if mistake == "lr replaced":  # distill.py's `syn_lr.detach().to(args.device).requires_grad_(True)`, moved below
        syn_lr = syn_lr.detach().requires_grad_(True)
    guard = GraphGuard(optimizers=[optimizer_img, optimizer_lr], check=check) if check else None

    def forward(x, flat):
        w = [t.view(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes)]
        return F.linear(F.relu(F.conv2d(x, w[0], w[1], padding=1)).flatten(1), w[2], w[3])

    for it in range(4):
        with guard.step() if guard else torch.enable_grad():
            start = it % 2
            target_params = expert[start + 2]
            student_params = [expert[start].clone().requires_grad_(True)]
            for step in range(3):
                idx = torch.randperm(4)[:2]
                ce_loss = F.cross_entropy(forward(image_syn[idx], student_params[-1]), label_syn[idx])
                grad = torch.autograd.grad(ce_loss, student_params[-1], create_graph=mistake != "no create_graph")[0]
                lr = syn_lr.item() if mistake == "lr item" else syn_lr
                student_params.append(student_params[-1] - lr * grad)
            grand_loss = F.mse_loss(student_params[-1], target_params, reduction="sum") / \
                F.mse_loss(expert[start], target_params, reduction="sum")
            optimizer_img.zero_grad()
            optimizer_lr.zero_grad()
            guard.backward(grand_loss) if guard else grand_loss.backward()
            optimizer_img.step()
            optimizer_lr.step()
    return image_syn.detach().clone(), syn_lr.detach().clone()


@pytest.mark.parametrize("check", MODES)
def test_trajectory_matching_with_a_learnable_lr_is_quiet_and_trains_as_without_the_guard(check):
    bare = distill(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(torch.equal(a, b) for a, b in zip(distill(check), bare))


@pytest.mark.parametrize("mistake, name", [("no create_graph", "image_syn"), ("lr item", "syn_lr")])
def test_an_optimizer_whose_tensors_the_unrolled_loss_never_reaches_is_warned_once(mistake, name):
    """The images (or the learning rate) get no gradient at any update: their optimizer steps and changes nothing,
    without an error. Said at its second update, naming them, with the fix of each."""
    bare = distill(None, mistake)
    with pytest.warns(UnusedGradientWarning) as record:
        assert all(torch.equal(a, b) for a, b in zip(distill("always", mistake), bare))
    said = [str(w.message) for w in record if issubclass(w.category, UnusedGradientWarning)]
    assert len(said) == 1, said
    assert f"`local {name}`, which has had no gradient" in said[0] and "(step 2, loss 'loss')" in said[0], said[0]
    fix = "needs create_graph=True" if mistake == "no create_graph" else ".item()"
    assert fix in said[0].split("To fix: ")[1].split("; or ")[0], said[0]



@pytest.mark.xfail(strict=True, reason="the optimizer holds a tensor that does not require grad, which the check of an "
                   "optimizer whose parameters never get a gradient leaves out (a frozen part); the loss reaches a "
                   "plain tensor no optimizer holds, which is never judged (an input's gradient, fast weights)")
def test_a_learnable_lr_made_to_require_grad_after_its_optimizer_was_built_is_warned():
    with pytest.warns(UnusedGradientWarning, match=r"build the optimizer after"):
        distill("always", "lr replaced")


GDTUO = Path(__file__).parents[1] / "watch" / "scripts" / "gdtuo_hyperoptimized_adam.py"
# the mistakes: the weights made again from themselves with their graph (no `param.detach()`), and Adam's moments
# read back without `.detach()`: each step's graph then holds every earlier step's
UNDETACHED = {"weights": ("params[name] = param.detach() - self.parameters['alpha'] * dparam",
                          "params[name] = param - self.parameters['alpha'] * dparam"),
              "moments": ("m = beta1 * self.cache[name]['m'].detach() +", "m = beta1 * self.cache[name]['m'] +")}


def hyperoptimize(check: str | None, mistake: str | None = None) -> list[torch.Tensor]:
    """Six steps of gdtuo's README loop (Adam whose hyperparameters SGD learns), its classes as the watch script has
    them (``mistake``: a key of ``UNDETACHED``), each step in a ``guard.step()``: the weights and Adam's alpha."""
    source = GDTUO.read_text().split("class MNIST_FullyConnected")[0]
    if mistake:
        source = source.replace(*UNDETACHED[mistake])
    gdtuo: dict = {}
    exec(compile(source, str(GDTUO), "exec"), gdtuo)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    optim = gdtuo["Adam"](optimizer=gdtuo["SGD"](1e-5))
    mw = gdtuo["ModuleWrapper"](model, optimizer=optim)
    mw.initialize()
    guard = GraphGuard(model, check=check) if check else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
        for _ in range(6):
            with guard.step() if guard else torch.enable_grad():
                mw.begin()
                loss = F.nll_loss(F.log_softmax(mw.forward(torch.randn(8, 6)), 1), torch.randint(0, 3, (8,)))
                mw.zero_grad()
                guard.backward(loss, create_graph=True) if guard else loss.backward(create_graph=True)
                mw.step()
    return [p.detach().clone() for p in [*model.parameters(), optim.parameters["alpha"]]]


@pytest.mark.parametrize("check", MODES)
def test_hypergradient_descent_is_quiet_and_trains_as_without_the_guard(check):
    bare = hyperoptimize(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
        assert all(torch.equal(a, b) for a, b in zip(hyperoptimize(check), bare))


@pytest.mark.parametrize("mistake", sorted(UNDETACHED))
def test_hyperoptimized_weights_or_moments_kept_with_their_graph_are_stopped_at_step_3(mistake):
    """Trained as without the guard, but every step's backward goes through all earlier steps' graphs, kept: the
    weights in the model's parameter slots (``m._parameters[k] = ...``) are named."""
    with pytest.raises(CarriedGraphError, match=r"\(step 3, loss 'loss'\).*held by `model\[2\]\.weight`.*grows every "
                                                r"step.*To fix: make the writes that grew its graph under "
                                                r"`torch.no_grad\(\)` \(or from `p.detach\(\)`\)"):
        hyperoptimize("always", mistake)


@pytest.mark.xfail(strict=True, reason="Adam's moments kept with their graph are held by the optimizer's cache "
                   "(`optim.cache['2.weight']['m']`), two dicts inside an object of the loop's variable, which the "
                   "search for a holder does not reach before the model's weights made from them; the fix offered "
                   "first (the writes under torch.no_grad(), or from p.detach()) leaves the moments' graph as it is")
def test_hyperoptimized_moments_kept_with_their_graph_are_named_by_the_cache():
    with pytest.raises(CarriedGraphError, match=r"held by `optim\.cache"):
        hyperoptimize("always", "moments")
