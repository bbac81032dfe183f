"""The first fix a message offers, applied as written, trains bit for bit as the correct loop (GraphGuard, the
Trainer; ``tests/watch`` runs the same patterns as scripts): SAM's second pass through the first pass's graph after
``first_step`` moved the weights in place, and a cache two module levels deep built by the first forward. The
correct loops stay quiet and bit-identical in every check mode."""
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import CarriedGraphError, DoubleBackwardError, GraphGuard, GraphReuseError, Trainer

from ..ddp_cases import SAM

CHECKS = ["always", "auto", "off"]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def trained(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(n)]


# -- SAM: the second pass --------------------------------------------------------------------------------------------
def sam_loop(second: str, check: str | None = "always", retain: bool = False) -> list[torch.Tensor]:
    """SAM by hand (davda54/sam's first_step/second_step) under GraphGuard (``check=None``: bare). ``second``: the
    second pass back-propagates the first pass's predictions (``reused``) or loss (``same``), the first fix of their
    errors as written (``reused, fixed`` / ``same, fixed``), or a fresh forward (``correct``)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backward = GraphGuard(model, opt, check=check).backward if check else torch.Tensor.backward
    for x, y in batches():
        predictions = model(x)
        loss = F.mse_loss(predictions, y)
        backward(loss, retain_graph=retain)  # the first backward
        with torch.no_grad():  # first_step: w + e(w), in place
            norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
            moves = [p.grad * (0.05 / (norm + 1e-12)) for p in model.parameters()]
            for p, e in zip(model.parameters(), moves):
                p.add_(e)
        opt.zero_grad()
        if second == "reused":
            backward(F.mse_loss(predictions, y))
        elif second == "reused, fixed":  # "compute `predictions` again after the change"
            predictions = model(x)
            backward(F.mse_loss(predictions, y))
        elif second == "same":
            backward(loss)
        elif second == "same, fixed":  # "compute `loss` again after the change"
            loss = F.mse_loss(model(x), y)
            backward(loss)
        else:
            backward(F.mse_loss(model(x), y))
        with torch.no_grad():  # second_step: back to w, the update with the gradient at w + e(w)
            for p, e in zip(model.parameters(), moves):
                p.sub_(e)
        opt.step()
        opt.zero_grad()
    return trained(model)


FIRST_BACKWARD = sam_loop.__code__.co_firstlineno + 10  # the line of `backward(loss, retain_graph=retain)`


@pytest.mark.parametrize("second, held", [("reused", "predictions"), ("same", "loss")])
def test_a_second_pass_through_a_graph_whose_weights_moved_in_place_is_fixed_by_a_fresh_forward(second, held):
    with pytest.raises(DoubleBackwardError, match=re.escape(f"at test_first_fixes.py:{FIRST_BACKWARD}") + ".*"
                       + re.escape("were changed in place (by an optimizer step, or by hand as SAM's first step moves "
                                   "the weights), so the graph holds values from before the change: retain_graph=True "
                                   "cannot help")) as info:
        sam_loop(second)
    assert info.value.fixes[0] == (f"compute `{held}` again after the change (a fresh forward) for this backward, so "
                                   "that its gradient is taken at the parameters as they are now")
    assert "`model.0.weight`" in str(info.value) and info.value.step == 1
    assert same(sam_loop(f"{second}, fixed"), sam_loop("correct", check=None))
    # what it replaces as the first fix: retaining the first pass's graph, which PyTorch then refuses
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sam_loop(second, check=None, retain=True)


def test_a_correct_sam_loop_stays_quiet_and_bit_identical_in_every_check_mode():
    bare = sam_loop("correct", check=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(same(sam_loop("correct", check), bare) for check in CHECKS)


class ManualSAM(Trainer):
    """SAM's two passes in manual mode; ``fresh``: the closure's loss is a fresh forward (else the first pass's)."""

    automatic = False
    fresh = True

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        if self.fresh:  # the first fix as written: "compute the loss again after the change"
            self.step(closure=lambda: self.backward(F.mse_loss(self.model(x), y)))
        else:
            self.step(closure=lambda: self.backward(loss))
        return loss


def sam_trainer(fresh: bool, check: str = "always") -> list[torch.Tensor]:
    model = mlp()
    trainer = ManualSAM(model=model, train_data=batches(), optimizer=SAM, max_steps=3, device="cpu", progress=False,
                        loggers=(), guard={"check": check})
    trainer.fresh = fresh
    trainer.fit()
    return trained(model)


def test_the_trainer_offers_a_fresh_forward_first_when_a_closure_hands_back_the_first_pass_loss():
    with pytest.raises(DoubleBackwardError, match=re.escape("this loss (MseLossBackward0, held by an unnamed tensor "
                                                            "(found by the garbage collector)) was already "
                                                            "back-propagated by the backward of 'loss' in this step")) \
            as info:
        sam_trainer(fresh=False)
    assert info.value.fixes[0].startswith("compute the loss again after the change (a fresh forward)")
    model = mlp()  # the same by hand
    opt = SAM(model.parameters())
    for x, y in batches():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()

        def closure():
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()

        opt.step(closure)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(same(sam_trainer(fresh=True, check=check), trained(model)) for check in CHECKS)


class Twice(Trainer):
    """Manual mode back-propagating one loss twice (``twice``), or once: the first fix of the first, as written."""

    automatic = False
    twice = True

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        if self.twice:
            self.backward(loss)
        self.step()
        return loss


def test_the_trainer_advises_one_loss_back_propagated_twice_away_rather_than_retained():
    """Retaining its graph would let the second backward add the same gradient again (seed 000)."""
    def fit(twice: bool) -> list[torch.Tensor]:
        model = mlp()
        trainer = Twice(model=model, train_data=batches(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        max_steps=3, device="cpu", progress=False, loggers=(), guard={"check": "always"})
        trainer.twice = twice
        trainer.fit()
        return trained(model)

    with pytest.raises(DoubleBackwardError, match=re.escape("this loss (MseLossBackward0, held by")) as info:
        fit(twice=True)
    assert info.value.fixes[0] == ("call self.backward once on each loss: delete the second (run with retain_graph=True, "
                                   "it would add the same gradient again)")  # manual mode's words
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert same(fit(twice=False), trained(model))


# -- a cache two module levels deep --------------------------------------------------------------------------------
class Rotary(nn.Module):
    """Rotary frequencies from a learned ``inv_freq``, cached by the first forward (``cache``) or made by each."""

    def __init__(self, dim: int, cache: bool):
        super().__init__()
        self.inv_freq = nn.Parameter(1.0 / 10 ** torch.linspace(0, 1, dim))
        self.cache, self.cached_freqs = cache, None

    def forward(self, x):
        freqs = self.cached_freqs
        if freqs is None:
            freqs = torch.outer(torch.arange(x.shape[0], dtype=x.dtype), self.inv_freq)
            if self.cache:
                self.cached_freqs = freqs
        return x * freqs.cos() + x.flip(-1) * freqs.sin()


class Fourier(nn.Module):
    """Fourier features of a fixed projection made with requires_grad=True (no optimizer holds it), cached by the
    first forward with their graph, or under torch.no_grad() (``no_grad``)."""

    def __init__(self, no_grad: bool):
        super().__init__()
        self.B, self.no_grad, self.cached = torch.randn(4, requires_grad=True), no_grad, None

    def forward(self, x):
        if self.cached is None:
            with torch.no_grad() if self.no_grad else torch.enable_grad():
                self.cached = torch.cat([self.B[:2].sin(), self.B[2:].cos()])
        return x * self.cached


class Deep(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.rot = inner

    def forward(self, x):
        return self.head(self.rot(self.proj(x)))


def rotary(cache: bool = True) -> nn.Module:
    torch.manual_seed(2)
    return Deep(Rotary(4, cache))


def fourier(no_grad: bool = False) -> nn.Module:
    torch.manual_seed(2)
    return Deep(Fourier(no_grad))


def cache_loop(model: nn.Module, edit: str | None = None, check: str | None = "always") -> list[torch.Tensor]:
    """A plain loop; ``edit``: a statement run before each forward (``before: ...``) or after each backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backward = GraphGuard(model, opt, check=check).backward if check else torch.Tensor.backward
    for x, y in batches(4):
        if edit and edit.startswith("before: "):
            exec(edit[len("before: "):])
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        backward(loss)
        if edit and not edit.startswith("before: "):
            exec(edit)
        opt.step()
    return trained(model)


def first_fix_code(err) -> str:
    """The first statement in backticks after "(`" in the first fix."""
    return re.search(r"\(`([^`]*)`", err.fixes[0]).group(1)


def test_a_cache_made_from_a_parameter_is_made_again_every_step_not_kept_detached():
    with pytest.raises(CarriedGraphError, match=re.escape("held by `model.rot.cached_freqs`")) as info:
        cache_loop(rotary())
    assert info.value.fixes[0].startswith("make `model.rot.cached_freqs` again every step instead of keeping it: it "
                                          "is made from `model.rot.inv_freq`")
    fix = first_fix_code(info.value)
    assert fix == "model.rot.cached_freqs = None"
    correct = cache_loop(rotary(cache=False), check=None)
    assert same(cache_loop(rotary(), "before: " + fix), correct)
    # the fix it replaces as the first: the cache kept detached trains with stale frequencies
    stale = cache_loop(rotary(), "model.rot.cached_freqs = model.rot.cached_freqs.detach()")
    assert not same(stale, correct)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(same(cache_loop(rotary(cache=False), check=check), correct) for check in CHECKS)
        assert all(same(cache_loop(rotary(), "before: " + fix, check=check), correct) for check in CHECKS)


def test_a_cache_made_from_no_trained_parameter_is_kept_without_its_graph():
    with pytest.raises(CarriedGraphError, match=re.escape("held by `model.rot.cached`")) as info:
        cache_loop(fourier())
    assert info.value.fixes[0].startswith("keep it without its graph: it depends on no trained parameter (only on "
                                          "`model.rot.B`), so build it under torch.no_grad()")
    fix = first_fix_code(info.value)
    assert fix == "model.rot.cached = model.rot.cached.detach()"
    correct = cache_loop(fourier(no_grad=True), check=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(same(cache_loop(fourier(), fix, check=check), correct) for check in CHECKS)
        assert all(same(cache_loop(fourier(no_grad=True), check=check), correct) for check in CHECKS)


class EdgeCache(nn.Module):
    """torch_geometric's ``GCNConv(cached=True)``: the first forward keeps ``(index, weight)`` in a private attribute,
    here with ``weight`` made from a learned ``edge_weight`` (PyG's docs: caching is for fixed graphs only);
    ``cached=False`` makes it every forward."""

    def __init__(self, cached: bool = True):
        super().__init__()
        self.edge_weight = nn.Parameter(torch.rand(4))
        self.cached, self._cached_edge_index = cached, None

    def forward(self, x):
        cache = self._cached_edge_index
        if cache is None:
            cache = torch.arange(4), self.edge_weight.softmax(0)
            if self.cached:
                self._cached_edge_index = cache
        return x * cache[1][cache[0]]


def test_a_cache_kept_in_a_layers_private_tuple_is_named_and_cleared_whole():
    """A module's private attribute is searched too (not the module's own ``_parameters``, ``_modules``, hooks), and a
    tuple is cleared as a whole: ``model.rot._cached_edge_index = None``, which the layer rebuilds; applied before each
    forward, it trains as ``cached=False``. (The step's output, through which the loss reaches the cache, was named
    before, with a detach that changed nothing.)"""
    torch.manual_seed(2)
    with pytest.raises(CarriedGraphError, match=re.escape("held by `model.rot._cached_edge_index[1]`")) as info:
        cache_loop(Deep(EdgeCache()))
    fix = first_fix_code(info.value)
    assert fix == "model.rot._cached_edge_index = None"
    torch.manual_seed(2)
    correct = cache_loop(Deep(EdgeCache(cached=False)), check=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for check in CHECKS:
            torch.manual_seed(2)
            assert same(cache_loop(Deep(EdgeCache()), "before: " + fix, check=check), correct)


class CachedStep(Trainer):
    """A regression step; ``before``: a statement run at the start of training_step (``self`` in scope)."""

    before = None

    def training_step(self, batch):
        if self.before:
            exec(self.before)
        x, y = batch
        return F.mse_loss(self.model(x), y)


def cache_trainer(model: nn.Module, before: str | None = None, check: str = "always") -> list[torch.Tensor]:
    trainer = CachedStep(model=model, train_data=batches(4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                         max_steps=4, device="cpu", progress=False, loggers=(), guard={"check": check})
    trainer.before = before
    trainer.fit()
    return trained(model)


def test_the_trainer_makes_a_parameter_cache_again_every_step_as_its_first_fix():
    with pytest.raises(CarriedGraphError, match=re.escape("held by `self.model.rot.cached_freqs`")) as info:
        cache_trainer(rotary())
    fix = first_fix_code(info.value)
    assert fix == "self.model.rot.cached_freqs = None"
    correct = cache_loop(rotary(cache=False), check=None)  # the loop by hand, without the cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(same(cache_trainer(rotary(), fix, check), correct) for check in CHECKS)
        assert all(same(cache_trainer(rotary(cache=False), check=check), correct) for check in CHECKS)


class Blocks(nn.Module):
    """Rotary blocks in an nn.ModuleList, each caching its frequencies and keeping its last output for logging."""

    def __init__(self, cache: bool = True):
        super().__init__()
        torch.manual_seed(2)
        self.blocks = nn.ModuleList(Deep(Rotary(4, cache)) for _ in range(2))

    def forward(self, x):
        outs = [block(x) for block in self.blocks]
        for block, out in zip(self.blocks, outs):
            block.last_out = out
        return sum(outs)


def test_a_cache_in_a_module_list_is_named_as_python_spells_it_so_that_its_fix_applies_as_written():
    """Each block's cache is named in turn: the fix of each, applied as written, and the loop trains as meant."""
    fixes: list[str] = []
    for _ in range(2):
        with pytest.raises(CarriedGraphError, match=r"held by `model\.blocks\[\d\]\.rot\.cached_freqs`") as info:
            cache_loop(Blocks(), "before: " + "; ".join(fixes) if fixes else None)
        fixes.append(first_fix_code(info.value))
    assert sorted(fixes) == [f"model.blocks[{i}].rot.cached_freqs = None" for i in range(2)]
    correct = cache_loop(Blocks(cache=False), check=None)
    with warnings.catch_warnings():  # each block keeps its own last output: two holders, no graphs piling up
        warnings.simplefilter("error")
        applied = cache_loop(Blocks(), "before: " + "; ".join(fixes), check="always")
    assert same(applied, correct)


class DictRotary(nn.Module):
    """Frequencies cached in a dict entry by the first forward (``key in cache``), from a learned ``inv_freq``."""

    def __init__(self, cache: bool = True):
        super().__init__()
        self.inv_freq, self.cache, self.caching = nn.Parameter(1.0 / 10 ** torch.linspace(0, 1, 4)), {}, cache

    def forward(self, x):
        if "freqs" not in self.cache:
            freqs = torch.outer(torch.arange(x.shape[0], dtype=x.dtype), self.inv_freq)
            if not self.caching:
                return x * freqs.cos()
            self.cache["freqs"] = freqs
        return x * self.cache["freqs"].cos()


class Runner:
    """The loop in a method (``self.model``), under a GraphGuard given only the optimizer; ``before``: a statement
    run before each forward."""

    def __init__(self, cache: bool, check: str | None):
        torch.manual_seed(2)
        self.model = Deep(DictRotary(cache))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.backward = GraphGuard(optimizers=self.opt, check=check).backward if check else torch.Tensor.backward

    def train(self, before: str | None = None) -> list[torch.Tensor]:
        for x, y in batches(4):
            if before:
                exec(before)
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            self.opt.step()
            self.opt.zero_grad()
        return trained(self.model)


def test_a_cache_in_a_dict_entry_in_a_method_s_loop_is_removed_before_each_forward():
    with pytest.raises(CarriedGraphError, match=re.escape("held by `self.model.rot.cache['freqs']`")) as info:
        Runner(cache=True, check="always").train()
    fix = first_fix_code(info.value)
    assert fix == "self.model.rot.cache.pop('freqs', None)"
    correct = Runner(cache=False, check=None).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(same(Runner(cache=True, check=check).train(fix), correct) for check in CHECKS)


# -- a GAN step whose D loss uses the fake with its graph ---------------------------------------------------------
def gan_loop(d_input: str, check: str | None = "always") -> list[torch.Tensor]:
    """DCGAN's update by hand, both updates in one ``guard.step()`` (mmengine's ``train_step`` over an optimizer
    dict) under GraphGuard given both optimizers (``check=None``: bare). D's loss takes the fake ``as is`` (the
    mistake), ``detached`` (the first fix, as written: ``fake.detach()``) or made under ``no_grad`` (the tutorial)."""
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 1), nn.Sigmoid())
    opt_g, opt_d = torch.optim.Adam(g.parameters(), lr=0.01), torch.optim.Adam(d.parameters(), lr=0.01)
    guard = GraphGuard(nn.ModuleList([g, d]), {"opt_g": opt_g, "opt_d": opt_d}, check=check or "off")
    torch.manual_seed(1)
    for _ in range(3):
        real, z = torch.randn(6, 8), torch.randn(6, 4)
        with guard.step():
            fake = g(z)
            if d_input == "no_grad":
                with torch.no_grad():
                    fake_d = g(z)
                pf = d(fake_d)
            else:
                pf = d(fake.detach() if d_input == "detached" else fake)
            pr = d(real)
            d_loss = F.binary_cross_entropy(pf, torch.zeros_like(pf)) + F.binary_cross_entropy(pr, torch.ones_like(pr))
            (guard.backward if check else torch.Tensor.backward)(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            pg = d(fake)
            (guard.backward if check else torch.Tensor.backward)(F.binary_cross_entropy(pg, torch.ones_like(pg)))
            opt_g.step()
            opt_g.zero_grad()
    return trained(g) + trained(d)


def test_a_gan_whose_discriminator_loss_keeps_the_fakes_graph_is_advised_the_detach_first():
    """D's backward freed the generator's part of the graph, and D's update ran since: ``retain_graph=True`` there
    would leave D's loss gradient in G's ``.grad`` for G's update, so the first fix is ``fake.detach()`` where D's
    loss uses it; applied as written, the loop trains bit for bit as the tutorial's, quiet in every check mode."""
    with pytest.raises(DoubleBackwardError, match=r"held by `local fake`.*To fix: if the earlier loss \('loss' at "
                                                  r"test_first_fixes\.py:\d+\) must not reach `fake` \(its update is "
                                                  r"done: a GAN's discriminator loss on the generator's output\), "
                                                  r"detach it where that loss uses it \(`fake\.detach\(\)`\)"):
        gan_loop("as is")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = [gan_loop("detached", check) for check in CHECKS]
    assert all(same(f, gan_loop("no_grad", None)) for f in fixed)


# -- a rollout kept for several updates: a target, not a cache -------------------------------------------------------
class PPO(Trainer):
    """PPO's update by hand in a Trainer (vwxyzjn/cleanrl ppo.py's shape): a rollout every ``every`` updates, kept for
    them, its old log-probabilities compared with the new ones (``no_grad``: the rollout under torch.no_grad())."""

    no_grad, every = True, 4

    def training_step(self, batch):
        if self.state.step % self.every == 0:
            obs = torch.randn(8, 4)
            with torch.no_grad() if self.no_grad else warnings.catch_warnings():
                dist = torch.distributions.Categorical(logits=self.model(obs))
                act = dist.sample()
                self.rollout = (obs, act, dist.log_prob(act))
        obs, act, old = self.rollout
        ratio = (torch.distributions.Categorical(logits=self.model(obs)).log_prob(act) - old).exp()
        return -(ratio * batch).mean()


def ppo(no_grad: bool, check: str = "always") -> list[torch.Tensor]:
    torch.manual_seed(0)
    trainer = PPO(model=nn.Linear(4, 2), train_data=list(torch.randn(8, 8)), max_steps=8, progress=False, loggers=(),
                  optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), guard={"check": check})
    trainer.no_grad = no_grad
    trainer.fit()
    return trained(trainer.model)


def test_old_log_probabilities_kept_with_their_graph_are_advised_no_grad_first_as_a_target():
    """The loss compares the model's new log-probabilities with kept ones made from the same parameters: making them
    again every step (a cache's fix) would make the ratio 1, so the target's fix comes first; applied, it trains as
    the correct loop, quiet."""
    with pytest.raises(CarriedGraphError, match=re.escape("held by `self.rollout[2]`")) as caught:
        ppo(no_grad=False)
    assert caught.value.step == 2
    assert caught.value.fixes[0].startswith("if it is a target the loss compares with, not a value to train through")
    assert "a rollout's log-probabilities kept for several updates), compute it under `torch.no_grad()`" \
        in caught.value.fixes[0]
    assert caught.value.fixes[1].startswith("make `self.rollout[2]` again every step")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = [ppo(no_grad=True, check=check) for check in CHECKS]
    assert all(same(fixed[0], f) for f in fixed[1:])


# -- a list of constants built before the loop: the fix detaches the whole list ----------------------------------------
def gram_loop(fixed: str) -> None:
    """Fast neural style's Gram matrices of the style image, a list made before the loop by a loss network left
    trainable (in no optimizer); ``fixed``: a statement run on the list after it is made (the first fix applied)."""
    torch.manual_seed(0)
    loss_net, model = nn.Linear(4, 4), mlp()
    grams = [f @ f.t() for f in (loss_net(torch.randn(3, 4)), torch.tanh(loss_net(torch.randn(3, 4))))]
    exec(fixed, {}, {"grams": grams})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt)
    for x, _ in batches():
        y = model(x[:3]) * torch.ones(3, 4)
        loss = sum(F.mse_loss(y @ y.t(), g) for g in grams)
        guard.backward(loss)
        opt.step()
        opt.zero_grad()


def test_the_first_fix_for_a_list_of_constants_built_before_the_loop_detaches_the_whole_list():
    """Every item keeps a graph made before the loop: a fix naming one item (`grams[1].detach()`) would stop the next
    run at `grams[0]`."""
    with pytest.raises(Exception, match=r"held by `local grams.*To fix: if it is meant as a constant") as err:
        gram_loop("")
    stored = re.search(r"store `(.+?)` instead", str(err.value)).group(1)  # one element's, or the whole list's
    target = stored[:-len(".detach()")] if re.fullmatch(r"grams\[\d\]\.detach\(\)", stored) else "grams[:]"
    gram_loop(f"{target} = {stored}")  # the first fix as written: no other error follows


# -- a KV cache written by each forward and read by its loss: detached, both caches ----------------------------------
class KVCache(nn.Module):
    """Meta llama's Attention (llama/model.py) trained as it is: each forward writes its keys and values into the
    preallocated ``cache_k`` and ``cache_v`` in place and attends over what it wrote there; ``cache=False`` attends
    over this forward's keys and values. ``write``: a slice (llama's), the whole cache (16 rows, the batch's), rows
    chosen by a tensor of positions (gpt-fast's ``k_out[:, :, input_pos] = k_val``) or ``index_copy_`` (lit-gpt's)."""

    def __init__(self, cache: bool = True, write: str = "slice"):
        super().__init__()
        rows = 16 if write == "whole" else 20
        self.wk, self.wv = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.cache, self.write, self.cache_k, self.cache_v = cache, write, torch.zeros(rows, 4), torch.zeros(rows, 4)

    def forward(self, x):
        keys, values = self.wk(x), self.wv(x)
        if self.cache:
            pos = torch.arange(len(x))
            for cache, new in ((self.cache_k, keys), (self.cache_v, values)):
                if self.write == "index_copy":
                    cache.index_copy_(0, pos, new)
                elif self.write == "index_put":
                    cache[pos] = new
                else:
                    cache[:len(x)] = new
            keys, values = self.cache_k[:len(x)], self.cache_v[:len(x)]
        return torch.softmax(x @ keys.t(), -1) @ values


def kv(cache: bool = True, write: str = "slice") -> nn.Module:
    torch.manual_seed(2)
    return Deep(KVCache(cache, write))


@pytest.mark.parametrize("write", ["slice", "whole", "index_put", "index_copy"])
def test_a_kv_cache_written_by_each_forward_is_detached_at_the_end_of_each_step_both_caches(write):
    """The caches keep the last step's write with its graph (PyTorch: 'backward through the graph a second time' at
    step 2). Their values are meant to persist, so the fix detaches them, not the adversarial patch's `x = x.clone()`
    before the write (the clone, stored back, keeps the last step's graph); both, or the next run stops at the other
    (written whole, the node reached is a `CopyBackwards`, not a `CopySlices`)."""
    with pytest.raises(CarriedGraphError, match=r"held by `model\.rot\.cache_[kv]`") as info:
        cache_loop(kv(write=write))
    assert info.value.fixes[0].startswith("detach the carried state at the end of each step")
    fix = first_fix_code(info.value)
    correct = cache_loop(kv(cache=False), check=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(same(cache_loop(kv(write=write), fix, check=check), correct) for check in CHECKS)


def recorded_before_the_loop(use: str) -> None:
    """A network's outputs on every example, computed once before the loop without torch.no_grad() and read by slices
    (``use``): "target", Learning without Forgetting's (Li & Hoiem) responses of the old head, the targets of a
    distillation loss against the trained network's fresh output on the same examples; "prediction", a full-graph
    output (a GNN's) read as each step's prediction; "other data", targets compared with its output on other data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(12, 4)
    y_o = model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt)
    for i in range(0, 12, 4):
        with guard.step():
            inputs = torch.randn(4, 4) if use == "other data" else x[i:i + 4]
            out = y_o[i:i + 4] if use == "prediction" else model(inputs)
            loss = F.kl_div(out.log_softmax(1), y_o[i:i + 4].softmax(1), reduction="batchmean") \
                if use != "prediction" else out.logsumexp(1).mean()
            guard.backward(loss)
            opt.step()
            opt.zero_grad()


def test_responses_recorded_before_the_loop_as_distillation_targets_are_kept_as_constants_first():
    """Told to be recomputed inside the loop, the responses of the old network would become the trained network's
    own outputs: a run that completes without a word and forgets. Made from the data the step's forward reads a slice
    of, and compared with that forward's output, they are a constant first; a prediction, or a value made from other
    data, is recomputed first."""
    with pytest.raises(GraphReuseError, match=r"held by `local y_o`.*To fix: if it is meant as a constant"):
        recorded_before_the_loop("target")
    for use in ("prediction", "other data"):
        with pytest.raises(GraphReuseError, match=r"held by `local y_o`.*To fix: recompute `y_o` inside the loop"):
            recorded_before_the_loop(use)
