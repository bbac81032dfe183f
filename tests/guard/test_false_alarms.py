"""Correct programs the guard once raised on, or changed: each runs clean and bit-identical to its
hand-written loop in every check mode; the mistake next to it is still caught."""
import random
import types
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from safeloop import CarriedGraphError, ConfigError, DoubleBackwardError, GraphGuard, GraphReuseError, Trainer

CHECKS = ["always", "auto", "off"]


def state(model):
    return {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}


def assert_same(ours, ref):
    a, b = state(ours), state(ref)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differs from the hand loop: {different}"


def run(cls, model, data, check, **kwargs):
    """Fit ``cls`` with warnings as errors: correct code must run with no error and no warning."""
    kwargs.setdefault("optimizer", lambda p: torch.optim.SGD(p, lr=0.05))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.fork's, say: not the guard's
        cls(model=model, train_data=data, max_steps=len(data), guard={"check": check}, device="cpu",
            progress=False, loggers=(), **kwargs).fit()
    return model


def gan(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.g = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    model.d = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.LeakyReLU(0.2),
                                  torch.nn.Linear(8, 1))
    return model


def batches(n, shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(n)]


@pytest.mark.parametrize("check", CHECKS)
def test_checkpointed_discriminator_with_batchnorm_is_never_re_run_by_the_guard(check):
    """Non-reentrant checkpoint re-runs the forward to unpack a saved tensor: the guard must not unpack
    one, or BatchNorm's running statistics move (they did: num_batches_tracked 134 against 24)."""
    data = batches(6, (8, 4))

    def d(model, x):
        return checkpoint(model.d, x, use_reentrant=False)

    def noise(i):
        return torch.randn(8, 2, generator=torch.Generator().manual_seed(100 + i))

    ref = gan()
    opt_d = torch.optim.Adam(ref.d.parameters(), 1e-3)
    opt_g = torch.optim.Adam(ref.g.parameters(), 1e-3)
    for i, real in enumerate(data):
        fake = ref.g(noise(i))
        d_loss = d(ref, fake.detach()).mean() - d(ref, real).mean()  # WGAN losses
        opt_d.zero_grad(); d_loss.backward(); opt_d.step()
        g_loss = -d(ref, fake).mean()
        opt_g.zero_grad(); g_loss.backward(inputs=list(ref.g.parameters())); opt_g.step()

    class GAN(Trainer):
        automatic = False

        def configure_optimizers(self):
            return {"d": torch.optim.Adam(self.model.d.parameters(), 1e-3),
                    "g": torch.optim.Adam(self.model.g.parameters(), 1e-3)}

        def training_step(self, real):
            fake = self.model.g(noise(self.state.step))
            d_loss = d(self.model, fake.detach()).mean() - d(self.model, real).mean()
            self.backward(d_loss, optimizer="d")
            self.step("d")
            g_loss = -d(self.model, fake).mean()
            self.backward(g_loss, optimizer="g")
            self.step("g")
            return {"d": d_loss, "g": g_loss}

    assert_same(run(GAN, gan(), data, check), ref)


@pytest.mark.parametrize("check", CHECKS)
def test_an_optimizer_over_part_of_the_model_is_fine_when_the_rest_still_takes_gradients(check):
    """Fine-tuning a head with ``SGD(model.head.parameters())`` and the encoder left requires_grad: the
    encoder's gradients pile up step after step, in the hand loop too. Only gradients the Trainer cleared
    tell that training_step ran backward itself (it raised DoubleBackwardError from step 2 on)."""
    data = [(x, x.sum(1, keepdim=True)) for x in batches(4, (8, 4))]
    ref = encoder_head()
    opt = torch.optim.SGD(ref.head.parameters(), lr=0.05)
    for x, y in data:
        F.mse_loss(ref.head(ref.enc(x)), y).backward()
        opt.step()
        opt.zero_grad()

    class Head(Trainer):
        def configure_optimizers(self):
            return torch.optim.SGD(self.model.head.parameters(), lr=0.05)

        def training_step(self, batch):
            x, y = batch
            return F.mse_loss(self.model.head(self.model.enc(x)), y)

    ours = run(Head, encoder_head(), data, check)
    assert_same(ours, ref)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.enc.parameters(), ref.enc.parameters()))


def encoder_head(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.enc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    model.head = torch.nn.Linear(8, 1)
    return model


def in_a_pool(fn, *args):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def forked(fn, *args):
    return torch.jit.wait(torch.jit.fork(fn, *args))


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("run_in", [in_a_pool, forked], ids=["thread pool", "jit.fork"])
def test_part_of_the_forward_in_another_thread_is_the_steps_own(run_in, check):
    """Node numbers are per thread: nodes a pool thread makes in the step can carry any number."""
    data = batches(6, (8, 4))

    def loss(model, x):
        return run_in(model.enc, x).sum(1).sin().mean() + model.head(run_in(model.enc, x * 2)).pow(2).mean()

    ref = encoder_head()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x in data:
        opt.zero_grad()
        loss(ref, x).backward()
        opt.step()

    class Threads(Trainer):
        def training_step(self, x):
            return loss(self.model, x)

    assert_same(run(Threads, encoder_head(), data, check), ref)


def ensemble_in_a_pool(guard=None):
    """A plain loop running an ensemble's members in a thread pool, their outputs kept in a variable of the loop
    (``outs = list(pool.map(...))``); the bare run's weights, or the guard's error."""
    torch.manual_seed(0)
    members = [torch.nn.Linear(4, 1) for _ in range(3)]
    opt = torch.optim.SGD([p for m in members for p in m.parameters()], lr=0.1)
    with ThreadPoolExecutor(2) as pool:
        for x in batches(4, (8, 4)):
            outs = list(pool.map(lambda m: m(x), members))
            loss = sum(o.pow(2).mean() for o in outs)
            opt.zero_grad()
            guard.backward(loss) if guard is not None else loss.backward()
            opt.step()
    return [p.detach().clone() for m in members for p in m.parameters()]


def test_an_ensemble_run_in_a_thread_pool_in_a_plain_loop_trains_as_without_the_guard():
    from safeloop import GraphGuard

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guarded = ensemble_in_a_pool(GraphGuard(check="always"))
    assert all(torch.equal(a, b) for a, b in zip(guarded, ensemble_in_a_pool(), strict=True))


class Replay:
    """A replay buffer keeping its transitions in a queue of its own, in two lists (pfrl's ``ReplayBuffer`` does so:
    ``buffer.memory._queue_back``)."""

    def __init__(self, transitions):
        self.memory = types.SimpleNamespace(front=[], back=types.SimpleNamespace(items=transitions))

    def sample(self, rng, n):
        return rng.sample(self.memory.front + self.memory.back.items, n)


def test_a_graph_from_before_the_step_in_a_variable_the_loop_sets_by_a_call_is_still_caught():
    """A variable the loop sets from a call before the backward holds this iteration's values (a pool's outputs),
    but not a node the last backward ran (a state carried with retain_graph=True: `h = carry(model, x, h)`), nor what
    it holds when set only in a branch (`if remake: adv = model(x)`, FGM's fix branch); a graph made before the loop
    that another variable holds is still found (`outs = list(kept)`), and named where the loop reads it
    (`batch[i]['target']` of `batch = buffer.sample(rng, 4)`, not inside the buffer)."""
    from safeloop import GraphGuard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt, h = torch.optim.SGD(model.parameters(), lr=0.01), None
    guard = GraphGuard(model, opt, check="always")
    with pytest.raises(CarriedGraphError, match=r"step 2, .*created during an earlier step and held by `local h`"):
        for x in batches(3, (3, 4)):
            h = carry(model, x, h)
            opt.zero_grad()
            guard.backward(h.pow(2).mean(), retain_graph=True)
            opt.step()

    members = [torch.nn.Linear(4, 1) for _ in range(3)]
    opt, guard = torch.optim.SGD([p for m in members for p in m.parameters()], lr=0.1), GraphGuard(check="always")
    with ThreadPoolExecutor(2) as pool:
        kept = list(pool.map(lambda m: m(torch.randn(8, 4)), members))
        with pytest.raises(GraphReuseError, match=r"step 1, .*built before the step \(before the loop\) and held by "
                                                  r"`local kept\[\d\]`"):
            for _ in range(3):
                outs = list(kept)
                opt.zero_grad()
                guard.backward(sum(o.pow(2).mean() for o in outs))
                opt.step()

    model, remake = torch.nn.Linear(4, 1), False
    adv = model(torch.randn(8, 4))
    opt, guard = torch.optim.SGD(model.parameters(), lr=0.1), GraphGuard(model, check="always")
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `local adv`"):
        for x in batches(3, (8, 4)):
            if remake:
                adv = model(x)
            opt.zero_grad()
            guard.backward((model(x) - adv).pow(2).mean())
            opt.step()

    rng, q = random.Random(0), torch.nn.Linear(4, 2)
    buffer = Replay([{"state": x, "target": q(x).max()} for x in batches(8, (4,))])
    opt, guard = torch.optim.SGD(q.parameters(), lr=0.1), GraphGuard(q, check="always")
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `local batch\[\d\]\['target'\]`"):
        for _ in range(3):
            batch = buffer.sample(rng, 4)
            opt.zero_grad()
            guard.backward(sum((q(b["state"]).max() - b["target"]) ** 2 for b in batch))
            opt.step()


POOL_SCRIPT = """
from concurrent.futures import ThreadPoolExecutor

import torch

torch.manual_seed(0)
members = [torch.nn.Linear(4, 1) for _ in range(3)]
opt = torch.optim.SGD([p for m in members for p in m.parameters()], lr=0.1)
with ThreadPoolExecutor(2) as pool:
    for x in torch.randn(4, 8, 4):
{body}
        opt.zero_grad()
        guard.backward(loss) if guard is not None else loss.backward()
        opt.step()
"""


POOL_BODIES = {
    "summed": "        loss = sum(pool.map(lambda m: m(x).pow(2).mean(), members))",
    "kept": "        outs = list(pool.map(lambda m: m(x), members))\n        loss = sum(o.pow(2).mean() for o in outs)",
}


@pytest.mark.parametrize("body", POOL_BODIES)
def test_a_loss_summed_from_a_thread_pools_outputs_in_a_script_trains_as_without_the_guard(tmp_path, body):
    """A script's loop holds the loss, made in the loop's thread from the pool's outputs, and perhaps the outputs, in
    a variable the loop sets from a call: the pool's nodes, numbered by their threads, are the step's own (the
    script's `loss` and `outs` are globals, which count no more than a function's locals)."""
    from safeloop import GraphGuard
    from safeloop.watch import Watch

    script = tmp_path / "pool.py"
    source = POOL_SCRIPT.format(body=POOL_BODIES[body])
    script.write_text(source)

    def run_script(guard=None):
        space = {"__name__": "__main__", "guard": guard}
        exec(compile(source, str(script), "exec"), space)
        return [p.detach().clone() for m in space["members"] for p in m.parameters()]

    bare = run_script()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for check in CHECKS:
            assert all(torch.equal(a, b) for a, b in zip(run_script(GraphGuard(check=check)), bare, strict=True))
            with Watch(GraphGuard(check=check), str(script)):
                assert all(torch.equal(a, b) for a, b in zip(run_script(), bare, strict=True))


SHARED = {}


def loss_through_a_helper(model, x):  # reaches the reused tensor through a name training_step does not use
    return model.head(model.enc(x) + SHARED["y"]).pow(2).mean()


def test_a_reused_graph_that_no_named_holder_holds_is_caught_when_a_second_step_reaches_it():
    """Without a holder in reach, a node numbered before the step may be another thread's: the guard
    waits for a second step to reach it, and then stops that step before its backward."""
    model = encoder_head()
    SHARED["y"] = torch.tanh(model.enc[0].bias * 2)  # built before training, saves its result

    class Reuses(Trainer):
        def training_step(self, x):
            return loss_through_a_helper(self.model, x)

    with pytest.raises(GraphReuseError, match=r"step 2.*reaches TanhBackward0.*an earlier backward already "
                       r"freed its saved tensors") as info:
        run(Reuses, model, batches(4, (8, 4)), "always")
    assert info.value.step == 2
    assert all(p.grad is None for p in model.parameters())


def net_and_multiplier(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.lam = torch.nn.Parameter(torch.tensor(0.5))
    return model


@pytest.mark.parametrize("check", CHECKS)
def test_an_update_between_two_backwards_is_fine_where_the_second_backward_does_not_read_it(check):
    """A Lagrangian method: the model steps, then the multiplier's backward(inputs=[lam]) runs only the
    lam * constraint branch, which never reads the weights the model's step changed in place."""
    data = batches(6, (8, 4))

    def lagrangian(model, x):
        out = model.net(x)
        return out.pow(2).mean() + model.lam * (out.mean() - 1)

    ref = net_and_multiplier()
    opt, opt_lam = torch.optim.SGD(ref.net.parameters(), lr=0.05), torch.optim.SGD([ref.lam], lr=0.1)
    for x in data:
        lag = lagrangian(ref, x)
        opt.zero_grad(); lag.backward(retain_graph=True, inputs=list(ref.net.parameters())); opt.step()
        opt_lam.zero_grad(); (-lag).backward(inputs=[ref.lam]); opt_lam.step()

    class Lagrangian(Trainer):
        automatic = False

        def configure_optimizers(self):
            return {"net": torch.optim.SGD(self.model.net.parameters(), lr=0.05),
                    "lam": torch.optim.SGD([self.model.lam], lr=0.1)}

        def training_step(self, x):
            lag = lagrangian(self.model, x)
            self.backward(lag, optimizer="net", retain_graph=True)
            self.step("net")
            self.backward(-lag, optimizer="lam")
            self.step("lam")
            return lag

    assert_same(run(Lagrangian, net_and_multiplier(), data, check), ref)


class SharedTrunk(Trainer):
    """Two heads on one trunk pass, each loss back-propagated by hand; the first does not retain."""

    automatic = False

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.05)

    def training_step(self, x):
        features = self.model.enc(x)
        first = self.model.head(features).pow(2).mean()
        self.backward(first)
        second = features.sin().mean()
        self.backward(second)
        self.step()
        return first


def test_a_second_backward_through_a_graph_the_first_freed_is_stopped_before_it_runs():
    model = encoder_head()
    with pytest.raises(DoubleBackwardError, match=r"step 1.*the loss reaches TanhBackward0, held by .*which the "
                       r"backward of 'loss' in this step already ran without retain_graph.*To fix: pass "
                       r"retain_graph=True to the backward of 'loss'") as info:
        run(SharedTrunk, model, batches(3, (8, 4)), "always")
    assert info.value.node_name == "TanhBackward0" and info.value.__cause__ is None  # before backward ran
    assert all(p.grad is None for p in model.parameters())


def test_a_second_backward_into_another_optimizer_is_stopped_only_where_the_first_ran():
    """With routing, the first backward runs only the paths to its optimizer's parameters."""
    class Routed(SharedTrunk):
        def configure_optimizers(self):
            return {"head": torch.optim.SGD(self.model.head.parameters(), lr=0.05),
                    "enc": torch.optim.SGD(self.model.enc.parameters(), lr=0.05)}

        def training_step(self, x):
            features = self.model.enc(x)
            self.backward(self.model.head(features).pow(2).mean(), optimizer="head")  # runs head's nodes only
            self.backward(features.sin().mean(), optimizer="enc")
            self.step("head")
            self.step("enc")

    ref = encoder_head()
    opt_head, opt_enc = (torch.optim.SGD(ref.head.parameters(), lr=0.05),
                         torch.optim.SGD(ref.enc.parameters(), lr=0.05))
    data = batches(4, (8, 4))
    for x in data:
        features = ref.enc(x)
        ref.head(features).pow(2).mean().backward(inputs=list(ref.head.parameters()))
        features.sin().mean().backward(inputs=list(ref.enc.parameters()))
        opt_head.step(); opt_enc.step(); opt_head.zero_grad(); opt_enc.zero_grad()
    assert_same(run(Routed, encoder_head(), data, "always"), ref)


class FullBackpropThroughTime(Trainer):
    """Carries its hidden state with its graph on purpose (full back-propagation through time over a
    short run), retaining the graph each step: the carried check is what it must turn off."""

    automatic = False
    region = False

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.01)

    def training_step(self, x):
        if self.region:
            with self.guard.ignore("carried"):
                self.h = carry(self.model, x, getattr(self, "h", None))
        else:
            self.h = carry(self.model, x, getattr(self, "h", None))
        loss = self.h.pow(2).mean()
        self.backward(loss, retain_graph=True)
        self.step()
        return loss


def carry(model, x, h):
    return torch.tanh(model(x) + (h if h is not None else 0) * 0.5)


def full_bptt_by_hand(data):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt, h = torch.optim.SGD(model.parameters(), lr=0.01), None
    for x in data:
        h = carry(model, x, h)
        opt.zero_grad(); h.pow(2).mean().backward(retain_graph=True); opt.step()
    return model


@pytest.mark.parametrize("how", ["setting", "region"])
def test_one_check_can_be_turned_off_for_the_run_or_for_a_region_of_code(how):
    data = batches(4, (3, 4))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(CarriedGraphError, match="created during an earlier step and held by `self.h`"):
        run(FullBackpropThroughTime, model, data, "always")

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    cls = type("Region", (FullBackpropThroughTime,), {"region": True}) if how == "region" else FullBackpropThroughTime
    kwargs = {"ignore": ["carried"]} if how == "setting" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls(model=model, train_data=data, max_steps=len(data), guard={"check": "always", **kwargs}, device="cpu",
            progress=False, loggers=(), optimizer=None).fit()
    assert_same(model, full_bptt_by_hand(data))


def test_an_unknown_check_name_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"guard.ignore: 'carry' is not one of reuse, carried, consumed, inplace, leak"):
        Trainer(model=torch.nn.Linear(2, 2), train_data=[torch.zeros(1, 2)], max_steps=1, guard={"ignore": ["carry"]})
    with pytest.raises(ConfigError, match=r"guard.ignore: 'carry' is not one of reuse, carried"):
        with Trainer(model=torch.nn.Linear(2, 2), train_data=[torch.zeros(1, 2)], max_steps=1).guard.ignore("carry"):
            pass


class TiedAutoencoder(torch.nn.Module):
    """A decoder weight tied to the encoder's as a transposed view made once, in ``__init__``: it shares the
    encoder weight's memory, so it follows every update (a graph built before training that saves nothing)."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(6, 3)
        self.decoder_weight = self.encoder.weight.t()
        self.decoder_bias = torch.nn.Parameter(torch.zeros(6))

    def forward(self, x):
        return F.linear(torch.sigmoid(self.encoder(x)), self.decoder_weight, self.decoder_bias)


class Reconstructs(Trainer):
    def training_step(self, x):
        return F.mse_loss(self.model(x), x)


@pytest.mark.parametrize("check", CHECKS)
def test_a_view_of_a_parameter_made_before_training_follows_it_and_is_not_warned_about(check):
    data = batches(4, (4, 6))
    torch.manual_seed(0)
    ref = TiedAutoencoder()
    recomputed = torch.nn.Linear(6, 3)  # the same weights, the transpose taken at every forward
    recomputed.load_state_dict(ref.encoder.state_dict())
    bias = torch.nn.Parameter(torch.zeros(6))
    opt = torch.optim.SGD([*recomputed.parameters(), bias], lr=0.05)
    for x in data:
        opt.zero_grad()
        F.mse_loss(F.linear(torch.sigmoid(recomputed(x)), recomputed.weight.t(), bias), x).backward()
        opt.step()
    torch.manual_seed(0)
    ours = run(Reconstructs, TiedAutoencoder(), data, check)
    assert torch.equal(ours.encoder.weight, recomputed.weight) and torch.equal(ours.decoder_bias, bias)


class OneShotOffload(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's activation offloading (``OffloadActivations`` on one stream): pack hands out an id, unpack
    gives the tensor back once and forgets it."""

    def __init__(self):
        self.tracker, self.count = {}, 0

        def pack(tensor):
            self.count += 1
            self.tracker[self.count] = tensor.clone()  # (to the CPU in torchtune)
            return self.count

        def unpack(key):
            assert key in self.tracker, f"untracked tensor with id {key}"
            return self.tracker.pop(key)

        super().__init__(pack, unpack)


@pytest.mark.parametrize("check", CHECKS)
def test_saved_tensors_unpacked_once_by_a_hook_are_left_to_the_backward_someone_else_calls(check):
    """``guard.check(loss)`` before a backward it does not call unpacks the step's saved tensors on a checked step,
    to explain an in-place change there. A tensor an unpack hook gives back is left packed: a one-shot hook would
    otherwise hand the real backward nothing ('untracked tensor'). Trained as without the guard."""

    def train(guard=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt, offload = torch.optim.AdamW(model.parameters(), lr=1e-2), OneShotOffload()
        checks = GraphGuard(model, opt, check=check).check if guard else lambda loss: None
        for x, y in zip(torch.randn(4, 8, 8), torch.randn(4, 8, 2)):
            with offload:
                out = model(x)
            loss = F.mse_loss(out, y)
            checks(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert not offload.tracker
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(train(guard=True), train())
