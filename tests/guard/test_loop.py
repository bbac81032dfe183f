"""``GraphGuard``: the guard's cases in a hand-written loop, with the same errors and fields."""
import copy
import gc
import random
import re
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune  # noqa: F401  (torch.nn.utils.prune)

from safeloop import (CarriedGraphError, ConfigError, DoubleBackwardError, GraphGuard, GraphLeakWarning,
                      GraphLifecycleWarning, GraphReuseError, InplaceModificationError, NoGraphError, Trainer,
                      UnusedGradientWarning)
from safeloop.guard.guard import Guard
from safeloop.guard.words import LOOP, TRAINER


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(3, 4) for _ in range(6)]


def state(model):
    return [p.detach().clone() for p in model.parameters()]


def test_a_graph_built_before_the_loop_is_caught_at_step_one_before_anything_changes():
    model, opt, data = setup()
    guard = GraphGuard(model)
    scale = model(torch.ones(1, 4)).sum()  # built once, with a graph, outside the loop
    before = state(model)
    with pytest.raises(GraphReuseError, match=re.escape("(step 1, loss 'loss'): the loss reaches SumBackward0, built "
                                                        "before the step (before the loop) and held by `local scale`")
                       + r".*To fix: recompute `scale` inside the loop") as info:
        for x in data:
            with guard.step():
                loss = (model(x) * scale).pow(2).mean()
                guard.backward(loss)
                opt.step()
                opt.zero_grad()
    assert (info.value.step, info.value.holder, info.value.node_name) == (1, "local scale", "SumBackward0")
    assert all(torch.equal(a, b) for a, b in zip(before, state(model)))
    assert all(p.grad is None for p in model.parameters())



@pytest.mark.parametrize("retain", [False, True], ids=["", "retain_graph=True"])
def test_a_graph_built_before_the_loop_says_what_this_backward_does_with_it(retain):
    """philtabor's MADDPG: every agent's actions computed once before the agents' updates, each update's backward
    told retain_graph=True. That backward frees nothing: the error says it keeps the stale graph instead."""
    model, opt, data = setup()
    guard = GraphGuard(model)
    scale = model(torch.ones(1, 4)).sum()
    state_now = ("this step's backward keeps it (retain_graph=True), so every step would back-propagate the same "
                 "graph, with the values it was made from, and fail once an update changes a tensor it saved"
                 if retain else "this step's backward will free its saved tensors")
    with pytest.raises(GraphReuseError, match=re.escape("held by `local scale` (its graph saves tensors in AddmmBackward0); "
                                                        + state_now)):
        for x in data:
            with guard.step():
                guard.backward((model(x) * scale).pow(2).mean(), retain_graph=retain)
                opt.step()
                opt.zero_grad()



def test_a_models_own_train_step_calling_the_guard_names_what_it_holds_as_the_loop_does():
    """mmengine's way: the loop calls the model's own ``train_step``, which back-propagates through the guard. What
    the model holds is named as the loop holds it (``model.prior``), not through the method's ``self``."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.prior = self.lin(torch.ones(1, 4))  # built once, with its graph

        def train_step(self, x, guard, opt):
            guard.backward((self.lin(x) * self.prior).pow(2).mean())
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    model = Model()
    opt, guard = torch.optim.SGD(model.parameters(), lr=0.1), GraphGuard(model)
    with pytest.raises(GraphReuseError, match=r"held by `model\.prior`.*To fix: recompute `model\.prior` inside the "
                                              r"loop"):
        for _ in range(3):
            with guard.step():
                model.train_step(torch.randn(3, 4), guard, opt)


def frozen_features_loop(detach: bool) -> list[torch.Tensor]:
    """A head trained on features a pretrained encoder, outside ``GraphGuard``'s model and in no optimizer, made
    once before the loop (``detach``: as the guard's first fix says)."""
    encoder, (head, opt, data) = torch.nn.Linear(4, 4), setup()
    features = encoder(torch.randn(3, 4))
    features = features.detach() if detach else features
    guard = GraphGuard(head, opt)
    for _ in range(3):
        with guard.step():
            guard.backward(head(features).pow(2).mean())
            opt.step()
            opt.zero_grad()
    return state(head)


def test_features_of_an_encoder_no_optimizer_trains_are_told_to_be_kept_as_a_constant_first():
    with pytest.raises(GraphReuseError, match=re.escape("To fix: if it is meant as a constant (no gradient through it "
                                                        "into `encoder.weight`, `encoder.bias`), store "
                                                        "`features.detach()` instead")):
        frozen_features_loop(detach=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frozen_features_loop(detach=True)


def kept_before_the_loop(how: str) -> None:
    """A loop whose loss reads a value of the trained model made before it, by four forwards: of four batches, summed
    (a statistic of the data: Deep SVDD's center) or of four time steps, each on the last one's output (a state
    made by an RNN cell, as an ODE solve's would be)."""
    model, opt, data = setup()
    if how == "batches":
        kept = sum(model(torch.randn(3, 4)) for _ in range(4)) / 4
    else:
        kept = torch.zeros(3, 4)
        for _ in range(4):
            kept = torch.tanh(model(kept))
    guard = GraphGuard(model, opt)
    for x in data:
        with guard.step():
            guard.backward((model(x) - kept).pow(2).mean())
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("how, first", [("batches", "if it is meant as a constant"),
                                        ("time", "recompute `kept` inside the loop")])
def test_a_value_made_by_forwards_side_by_side_is_told_to_be_kept_as_a_constant_first_not_one_made_in_time(how, first):
    with pytest.raises(GraphReuseError, match=re.escape(f"To fix: {first}")):
        kept_before_the_loop(how)


def conditioned_on_prompts_embedded_before_the_loop(inside: bool) -> list[torch.Tensor]:
    """DreamBooth with its text encoder trained (diffusers' train_dreambooth.py, --train_text_encoder): the model is
    conditioned on the embeddings of two prompts (the instance's, the class's), made by the encoder before the loop and
    stacked, the encoder in the optimizer; ``inside``: made inside the loop (the first fix applied)."""
    torch.manual_seed(0)
    encoder, model = torch.nn.Linear(4, 4), torch.nn.Linear(8, 4)
    opt = torch.optim.SGD([*model.parameters(), *encoder.parameters()], lr=0.1)
    prompts, data = torch.randn(2, 4), [torch.randn(2, 4) for _ in range(3)]
    embeds = torch.stack([encoder(prompts[0]), encoder(prompts[1])])
    guard = GraphGuard(model, opt)
    for x in data:
        with guard.step():
            if inside:
                embeds = torch.stack([encoder(prompts[0]), encoder(prompts[1])])
            guard.backward(model(torch.cat([x, embeds], 1)).pow(2).mean())
            opt.step()
            opt.zero_grad()
    return state(encoder)


def test_values_made_side_by_side_and_stacked_not_reduced_are_told_to_be_recomputed_first():
    """Several forwards of a trained encoder kept apart (stacked), not reduced into one value (a sum, a mean), are
    per-input values that a step computes again, not a statistic of the data."""
    with pytest.raises(GraphReuseError, match=re.escape("To fix: recompute `embeds` inside the loop")):
        conditioned_on_prompts_embedded_before_the_loop(inside=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conditioned_on_prompts_embedded_before_the_loop(inside=True)


def attacked_twice(clear: str = "") -> None:
    """FGSM adversarial training over two batches kept in a list, for two epochs; ``clear``: how the attack clears
    the kept batch's `.grad` first ("none", "zero", "data": through `.data`), or "fresh" (a new batch each step)."""
    model, opt, _ = setup()
    batches = [torch.rand(3, 4) for _ in range(2)]
    guard = GraphGuard(model, opt)
    for _ in range(2):
        for data in batches:
            with guard.step():
                data = data.clone() if clear == "fresh" else data
                data.requires_grad = True
                if data.grad is not None and clear:
                    if clear == "none":
                        data.grad = None
                    else:
                        (data.grad.data if clear == "data" else data.grad).zero_()
                model.zero_grad()
                guard.backward(model(data).pow(2).mean())  # the attack's backward
                perturbed = data + 0.1 * data.grad.sign()
                opt.zero_grad()
                guard.backward(model(perturbed.detach()).pow(2).mean())
                opt.step()


def test_an_attack_reading_the_grad_of_a_kept_batch_never_cleared_is_warned():
    """FGSM adversarial training (PyTorch's fgsm_tutorial's attack) over batches kept in a list for two epochs:
    `data.requires_grad = True` on the kept tensor, whose `.grad` nothing clears, so its second attack goes along the
    sign of the sum of both epochs' input gradients. Cleared (or a new tensor each step), nothing is said."""
    with pytest.warns(GraphLifecycleWarning, match=re.escape("(step 3, loss 'loss'): this backward adds to "
                                                             "`batches[0].grad`, which an attack's backward of an "
                                                             "earlier step wrote")):
        attacked_twice()
    for clear in ("none", "zero", "data", "fresh"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            attacked_twice(clear)


def test_kept_inputs_whose_gradient_an_update_uses_or_a_closure_writes_are_no_attack():
    """Quiet: kept real batches whose `.grad` a GAN's discriminator backward (with an R1 penalty) writes and nothing
    clears or reads (the backward's gradients go to the update), and kept collocation points of a physics-informed
    net trained by L-BFGS, whose closure clears the parameters' gradients before each of its backwards."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.01)
    reals = [torch.randn(3, 4) for _ in range(2)]
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    lbfgs = torch.optim.LBFGS(net.parameters(), max_iter=3)
    points = [torch.rand(5, 1, requires_grad=True) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard = GraphGuard(torch.nn.ModuleList([gen, disc]), [opt_g, opt_d])
        for _ in range(3):
            for real in reals:
                with guard.step():
                    real.requires_grad_(True)
                    opt_d.zero_grad()
                    out = disc(real).sum()
                    grad, = torch.autograd.grad(out, real, create_graph=True)
                    guard.backward(out + disc(gen(torch.randn(3, 2)).detach()).sum() + grad.pow(2).sum())
                    opt_d.step()
                    opt_g.zero_grad()
                    guard.backward(-disc(gen(torch.randn(3, 2))).sum())
                    opt_g.step()
        guard = GraphGuard(net, lbfgs)
        for _ in range(3):
            for x in points:
                with guard.step():
                    def closure():
                        lbfgs.zero_grad()
                        u = net(x)
                        du, = torch.autograd.grad(u.sum(), x, create_graph=True)
                        loss = (du - u).pow(2).mean()
                        guard.backward(loss)
                        return loss
                    lbfgs.step(closure)


def teacher_then_student(no_grad: bool) -> list[torch.Tensor]:
    """Two training loops under one guard: a teacher trained, then a student on the teacher's outputs, computed once
    between the loops (``no_grad``: under ``torch.no_grad()``, as they should be)."""
    (teacher, opt_t, data), (student, opt_s, _) = setup(), setup(1)
    guard = GraphGuard()
    for x in data:
        with guard.step():
            guard.backward(teacher(x).pow(2).mean())
            opt_t.step()
            opt_t.zero_grad()
    with torch.no_grad() if no_grad else nullcontext():
        targets = teacher(torch.stack(data))
    for _ in range(2):
        for x, target in zip(data, targets):
            with guard.step():
                guard.backward((student(x) - target).pow(2).mean())
                opt_s.step()
                opt_s.zero_grad()
    return state(student)


def test_a_second_training_loop_starts_training_again_what_was_made_before_it_is_built_before_its_steps():
    with pytest.raises(GraphReuseError, match=re.escape("(step 7, loss 'loss'): the loss reaches ViewBackward0, built "
                                                        "before the step (before the loop) and held by `local "
                                                        "targets`")):
        teacher_then_student(no_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        teacher_then_student(no_grad=True)


def test_a_graph_from_before_the_loop_that_every_backward_keeps_is_stopped_once_an_update_made_it_stale():
    """A backward with create_graph=True, which keeps the graph (LiSSA's torch.autograd.grad through a gradient taken
    before its loop, nimarb/pytorch_influence_functions' s_test), may go through a graph built before the loop while
    nothing it was made from has changed: step 1's gradient is a fresh forward's. After an update it would take the
    gradient at the old weights: stopped before that backward (it was stopped at step 1)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(3, 4) for _ in range(3)]
    fresh = copy.deepcopy(model)
    (fresh(data[0]) - fresh(torch.ones(1, 4)).tanh()).pow(2).mean().backward()
    guard = GraphGuard(model, opt)
    anchor = model(torch.ones(1, 4)).tanh()  # built once, with a graph, outside the loop
    grads = []
    with pytest.raises(GraphReuseError, match=re.escape("(step 2, loss 'loss'): the loss reaches TanhBackward0, built "
                                                        "before the step (before the loop) and held by `local anchor`")
                       + r".*`model.weight`, `model.bias`, which it was made from, were updated since .*"
                         r"To fix: recompute `anchor` inside the loop"):
        for x in data:
            with guard.step():
                loss = (model(x) - anchor).pow(2).mean()
                guard.backward(loss, create_graph=True)
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
                opt.zero_grad()
    assert len(grads) == 1 and all(torch.equal(a, p.grad) for a, p in zip(grads[0], fresh.parameters()))


def play_then_learn(guarded: bool, keep_graph: bool = False):
    """REINFORCE with each episode played above the step (the loop's body makes the log-probabilities' graphs, then
    ``with guard.step()`` learns from them), and MuZero's replay buffer of self-play targets (werner-duvaud/
    muzero-general self_play.py / trainer.py: the root value of each position is a target, searched under
    ``torch.no_grad()``); ``keep_graph``: the root values stored with their graphs, and the oldest game replayed."""
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    value = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam([*policy.parameters(), *value.parameters()], lr=0.01)
    guard = GraphGuard(policy, opt) if guarded else None
    buffer, pick = [], random.Random(0)
    for episode in range(4):
        log_probs, rewards = [], []
        for t in range(3):
            obs = torch.randn(4)
            dist = torch.distributions.Categorical(logits=policy(obs))
            action = dist.sample()
            log_probs.append(dist.log_prob(action))
            rewards.append(float(action))
            with nullcontext() if keep_graph else torch.no_grad():
                root = value(obs)
            buffer.append({"obs": obs, "value": root})
        games = [buffer[0], pick.choice(buffer)]
        with guard.step() if guarded else nullcontext():
            returns = torch.tensor(rewards).flip(0).cumsum(0).flip(0)
            loss = -(torch.stack(log_probs) * returns).sum()
            loss = loss + sum((value(g["obs"]) - g["value"]).pow(2).sum() for g in games)
            opt.zero_grad()
            if guarded:
                guard.backward(loss)
            else:
                loss.backward()
            opt.step()
    return [p.detach().clone() for p in [*policy.parameters(), *value.parameters()]]


@pytest.mark.parametrize("check", ["always", "auto"])
def test_graphs_the_loop_makes_above_its_first_with_guard_step_are_the_first_steps_own(check):
    """The first ``with guard.step()`` inside a loop: training began where the loop began (after the graphs the
    variables it does not assign hold, as under watch), not at the ``with``: an episode played above it is the first
    step's own, as it is every later step's (it was a GraphReuseError at step 1, 'before the loop', naming
    `log_probs[0]`); a target stored with its graph and replayed is still stopped, at step 2, naming the buffer."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(torch.equal(a, b) for a, b in zip(play_then_learn(False), play_then_learn(True)))
    with pytest.raises(CarriedGraphError, match=re.escape("(step 2, loss 'loss'): the loss reaches ")
                       + r".*held by `local buffer\[0\]\['value'\]`.*compute it under `torch.no_grad\(\)`") as info:
        play_then_learn(True, keep_graph=True)
    # the value head is trained by the optimizer given, though not part of the model given
    assert "no trained parameter" not in str(info.value)


def carry(guard, model, opt, data, detach: bool, **backward):
    h = torch.zeros(3, 4)
    for x in data:
        with guard.step() if guard is not None else _nothing():
            h = torch.tanh(model(x) + h)
            loss = h.pow(2).mean()
            if guard is None:
                loss.backward(**backward)
            else:
                guard.backward(loss, **backward)
            opt.step()
            opt.zero_grad()
            if detach:
                h = h.detach()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_hidden_state_carried_across_steps_is_caught_at_step_two_naming_the_variable():
    model, opt, data = setup()
    with pytest.raises(CarriedGraphError, match=re.escape("(step 2, loss 'loss'): the loss reaches TanhBackward0, "
                                                          "created during an earlier step and held by `local h`")
                       + r".*To fix: detach the carried state at the end of each step \(`h = h.detach\(\)`\)"):
        carry(GraphGuard(model), model, opt, data, detach=False)



def test_a_state_kept_on_the_model_is_detached_once_though_another_object_holds_the_model_too():
    """A memory the model keeps with its graph (``self.memory = ...`` in forward), and an object of the loop's that
    holds the same model (a snapshot for checks): the fix detaches the memory once, by the loop's name, not again
    through the other object, which reaches the very same tensor."""
    class Memory(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.memory = torch.nn.Linear(4, 4), torch.zeros(1, 4)

        def forward(self, x):
            self.memory = torch.tanh(self.lin(x).mean(0, keepdim=True) + self.memory)
            return self.memory.pow(2).mean()

    class Snapshot:
        def __init__(self, model):
            self.model = model

    model, (_, _, data) = Memory(), setup()
    opt, guard, snapshot = torch.optim.SGD(model.parameters(), lr=0.1), GraphGuard(model), Snapshot(model)
    with pytest.raises(CarriedGraphError, match=r"held by `model\.memory`.*To fix: detach the carried state at the end "
                                                r"of each step \(`model\.memory = model\.memory\.detach\(\)`\) so") \
            as caught:
        for x in data:
            with guard.step():
                guard.backward(model(x))
                opt.step()
                opt.zero_grad()
    assert "snapshot" not in str(caught.value) and snapshot.model is model


class Unregistered(torch.nn.Module):
    """A layer kept in a plain list (not registered), and a state the loop keeps on the module."""

    def __init__(self):
        super().__init__()
        self.lin, self.extra, self.h = torch.nn.Linear(4, 4), [torch.nn.Linear(4, 4)], None

    def forward(self, x):
        return self.extra[0](self.lin(x))


def test_a_compiled_models_attributes_and_parameters_are_named_as_the_loop_reads_them():
    """``torch.compile(m)`` wraps ``m`` (its ``_orig_mod``) and reads and writes attributes through to it: the fix
    names ``model.h``, as the loop wrote it, not ``model._orig_mod.h``."""
    torch.manual_seed(0)
    model = torch.compile(Unregistered(), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt)
    with pytest.warns(UnusedGradientWarning, match=re.escape("reaches `model.extra[0].weight`, `model.extra[0].bias`")), \
            pytest.raises(CarriedGraphError, match=re.escape("held by `model.h`") + ".*" + re.escape(
                "(`model.h = model.h.detach()`)")):
        for step in range(3):
            with guard.step():
                out = model(torch.randn(8, 4))
                model.h = out if step == 0 else model.h + out
                guard.backward(model.h.pow(2).mean())
                opt.step()
                opt.zero_grad()


class Consistency:
    """A loss of the model's output plus a penalty towards the last step's output mean, kept on ``self.prev`` with its
    graph and replaced by this step's before the loss is handed back (transformers' ``Trainer.compute_loss``
    overridden so): only the loss reaches the last step's graph by then."""

    def __init__(self, model):
        self.model, self.prev = model, None

    def __call__(self, x):
        out = self.model(x)
        mean = out.mean(0)
        loss = out.pow(2).mean() if self.prev is None else out.pow(2).mean() + (mean - self.prev).pow(2).sum()
        self.prev = mean
        return loss


def test_a_freed_graph_no_variable_holds_any_more_is_caught_by_check_before_someone_elses_backward():
    """``guard.check(loss)`` then a backward it does not run: a node of the last step whose saved tensors that
    step's backward freed is carried, held by nothing but the loss (not a node another thread made in this step,
    whose tensors no backward has freed): stopped before the backward fails half-way, naming the attribute that
    kept it (it holds this step's value by then: made alike, from the same parameters, not from the old one)."""
    model, opt, data = setup()
    guard = GraphGuard(model, opt)
    compute_loss = Consistency(model)
    with pytest.raises(CarriedGraphError, match=re.escape(
            "(step 2, loss 'loss'): the loss reaches MeanBackward1, created during an earlier step and kept in "
            "`compute_loss.prev`, which this step then set to its own value (the loss read the old one)")
            + ".*already freed the saved tensors.*" + re.escape(
            "To fix: store it detached where it is set (`compute_loss.prev = ....detach()`)")):
        for x in data:
            loss = compute_loss(x)
            guard.check(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_pruned_weight_read_before_the_forward_is_named_not_the_local_made_from_it():
    """``penalty``, made in this step, is the only variable whose graph reaches the last forward's pruned weight:
    the error names the weight the forward makes again, not ``penalty`` (whose detaching would drop its gradient)."""
    model, opt, data = setup()
    torch.nn.utils.prune.random_unstructured(model, "weight", amount=0.5)
    guard = GraphGuard(model)
    with pytest.raises(CarriedGraphError) as caught:
        for i, x in enumerate(data):
            with guard.step():
                penalty = model.weight.abs().sum() if i else torch.zeros(())  # from the second step on
                loss = model(x).pow(2).mean() + 1e-3 * penalty
                guard.backward(loss)
                opt.step()
                opt.zero_grad()
    err = caught.value
    assert (err.step, err.holder) == (2, "model.weight")
    assert "made by an earlier step's forward as `model.weight`, which each forward makes again" in str(err)
    assert err.fixes[0] == "read `model.weight` after this step's forward, so that it holds this step's value"


def test_an_lstm_state_carried_across_steps_is_detached_as_a_whole_tuple_in_the_fix():
    """word_language_model's loop without its ``repackage_hidden``: the state is the tuple ``(h, c)``, whose
    items cannot be assigned one by one."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 4)
    opt = torch.optim.SGD(lstm.parameters(), lr=0.1)
    guard = GraphGuard(lstm, opt)
    hidden = (torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))
    with pytest.raises(CarriedGraphError, match=re.escape(
            "held by `local hidden[0]`; an earlier backward already freed the saved tensors of its graph") + ".*"
            + re.escape("To fix: detach the carried state at the end of each step "
                        "(`hidden = tuple(t.detach() for t in hidden)`)")):
        for x in torch.randn(3, 2, 3, 4):
            out, hidden = lstm(x, hidden)
            guard.backward(out.pow(2).mean())
            opt.step()
            opt.zero_grad()


class Memories(torch.nn.Module):
    """Transformer-XL's recurrence in two layers: each layer's output is its memory for the next segment, and
    ``forward`` returns a new list of them (x-transformers' ``return_mems=True``)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x, mems=None):
        new = []
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x) + (mems[i] if mems is not None else 0))
            new.append(x)
        return x, new


def memories_loop(guard: GraphGuard | None, detach: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Memories()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mems = None
    for x in torch.randn(4, 3, 4):
        out, mems = model(x, mems)
        loss = out.pow(2).mean()
        guard.backward(loss) if guard else loss.backward()
        opt.step()
        opt.zero_grad()
        if detach:
            mems = [t.detach() for t in mems]
    return state(model)


def test_a_list_made_anew_every_step_from_the_last_is_detached_as_a_whole_not_emptied():
    """Memories carried with their graphs in a list the model makes anew every step: a carried state, as an LSTM's
    ``(h, c)``; not a list piling up a value per step, whose fix (``del mems[:]``) would train with no memory at all.
    The advised detach trains quiet, as the bare loop with it."""
    with pytest.raises(CarriedGraphError, match=re.escape("held by `local mems[1]`") + ".*" + re.escape(
            "To fix: detach the carried state at the end of each step (`mems = [t.detach() for t in mems]`)")) as err:
        memories_loop(GraphGuard(check="always"), detach=False)
    assert err.value.step == 2 and "[:]" not in str(err.value) and "append" not in str(err.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = memories_loop(GraphGuard(check="always"), detach=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, memories_loop(None, detach=True)))


def gru_loop(guard: GraphGuard | None, detach_after: bool) -> list[torch.Tensor]:
    """A GRU's state written back only after the update (``h = h_new``), the new value computed from the old in
    the step before; ``detach_after``: the fix the guard gives, as written, on the line after."""
    torch.manual_seed(0)
    rnn, head = torch.nn.GRU(4, 8, batch_first=True), torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(list(rnn.parameters()) + list(head.parameters()), lr=0.1)
    h = torch.zeros(1, 2, 8)
    for x, y in zip(torch.randn(4, 2, 5, 4), torch.randn(4, 2, 1)):
        out, h_new = rnn(x, h)
        loss = F.mse_loss(head(out[:, -1]), y)
        opt.zero_grad()
        guard.backward(loss) if guard is not None else loss.backward()
        opt.step()
        h = h_new
        if detach_after:
            h = h.detach()
    return [p.detach().clone() for p in [*rnn.parameters(), *head.parameters()]]


def test_a_state_written_back_after_the_update_is_advised_as_a_carried_state_not_as_a_cache():
    """Held as it was made in step 1, as a cache is; but the step's new value of the same shape (``h_new``) is
    made from it: a state carried on purpose, whose fix is to detach it, not to make it again every step."""
    with pytest.raises(CarriedGraphError, match=re.escape("held by `local h`; an earlier backward already freed")) \
            as caught:
        gru_loop(GraphGuard(), detach_after=False)
    assert caught.value.fixes[0] == ("detach the carried state at the end of each step (`h = h.detach()`) so each "
                                     "step back-propagates through its own graph only (truncated BPTT)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = gru_loop(GraphGuard(check="always"), detach_after=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, gru_loop(None, detach_after=True)))


def test_a_scalar_made_once_from_a_trained_tensor_is_still_advised_as_a_cache():
    """The step's loss is made from the kept scalar and has its shape: no new value of a carried state."""
    torch.manual_seed(0)
    model, log_alpha = torch.nn.Linear(4, 1), torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([*model.parameters(), log_alpha], lr=0.1)
    guard, alpha = GraphGuard(), None
    with pytest.raises(CarriedGraphError) as caught:
        for x in torch.randn(3, 8, 4):
            if alpha is None:
                alpha = log_alpha.exp()
            loss = (model(x) ** 2).mean() * alpha
            opt.zero_grad()
            guard.backward(loss)
            opt.step()
    assert caught.value.fixes[0].startswith("make `alpha` again every step instead of keeping it: it is made from "
                                            "`local log_alpha`")


def test_a_state_set_up_after_the_loss_and_kept_as_made_is_advised_the_detach_first():
    """A memory bank of past outputs (pytorch-metric-learning's reference embeddings, by hand), set up after the
    update for the next step's loss and kept as it was made: a state carried on purpose, not a cache the loss read
    (``alpha`` above, made before its loss). The detach comes first; applied, it trains as the loop with the bank
    made under ``no_grad``, quiet."""
    def bank(guard, fix=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        queue = torch.zeros(0, 3)
        for x in torch.randn(4, 5, 4):
            with guard.step() if guard is not None else nullcontext():
                out = model(x)
                loss = (out @ torch.cat([out, queue]).T).pow(2).mean()
                opt.zero_grad()
                guard.backward(loss) if guard is not None else loss.backward()
                opt.step()
                with torch.no_grad() if fix == "no_grad" else nullcontext():
                    queue = torch.cat([queue, out])[-8:]
                if fix == "detach":
                    queue = queue.detach()
        return list(model.parameters())

    with pytest.raises(CarriedGraphError, match=re.escape("held by `local queue`")) as caught:
        bank(GraphGuard(check="always"))
    assert caught.value.fixes[0] == ("detach the carried state at the end of each step (`queue = queue.detach()`) "
                                     "so each step back-propagates through its own graph only (truncated BPTT)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = bank(GraphGuard(check="always"), fix="detach")
    assert all(torch.equal(a, b) for a, b in zip(fixed, bank(None, fix="no_grad")))


def test_a_step_the_guard_does_not_check_is_explained_when_its_backward_fails():
    """check=off: no pre-flight, but the autograd error of a carried graph still comes back explained."""
    model, opt, data = setup()
    with pytest.raises(CarriedGraphError, match=re.escape("(step 2, loss 'loss'): the loss reaches TanhBackward0, "
                                                          "created during an earlier step and held by `local h`; an "
                                                          "earlier backward already freed the saved tensors")) as info:
        carry(GraphGuard(model, check="off"), model, opt, data, detach=False)
    assert "Trying to backward through the graph a second time" in str(info.value.__cause__)


@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_a_correct_loop_under_the_guard_computes_bit_for_bit_what_the_bare_loop_computes(check):
    results = []
    for guard in (None, True):
        model, opt, data = setup()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            carry(GraphGuard(model, check=check) if guard else None, model, opt, data * 4, detach=True)
        results.append(state(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_backward_twice_on_one_loss_is_caught_before_it_runs():
    model, opt, data = setup()
    guard = GraphGuard(model, opt)
    loss = model(data[0]).tanh().sum()
    guard.backward(loss)
    with pytest.raises(DoubleBackwardError, match=re.escape("this loss (SumBackward0, held by `local loss`) was "
                                                            "already back-propagated earlier in this step")
                       + r".*pass retain_graph=True to every backward but the last"):
        guard.backward(loss)
    loss = model(data[0]).tanh().sum()  # retained: a second backward is meant and works
    guard.backward(loss, retain_graph=True)
    guard.backward(loss)


def seed000_loop(second: str | None) -> list[torch.Tensor]:
    """Seed 000's first example: backward, update, then ``second``: ``"backward"`` on the same loss again (the
    mistake), ``"retained"``: again, the first backward retaining the graph so that it runs (the advice the
    seed texts warn about), None: no second backward (the guard's advice). Returns the trained parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Tanh(), torch.nn.Flatten(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt)
    for x in torch.randn(3, 1, 4):
        loss = model(x)
        guard.backward(loss, retain_graph=second == "retained")
        opt.step()
        opt.zero_grad()
        if second is not None:
            guard.backward(loss)
    return state(model)


def test_backward_twice_on_one_loss_is_advised_away_and_the_advice_trains_as_the_intended_loop():
    """Retaining the graph would let the second backward run and add the same gradient again."""
    with pytest.raises(DoubleBackwardError) as info:
        seed000_loop("backward")
    assert info.value.fixes == [
        "call backward once on each loss: delete the second backward on it (made to run with retain_graph=True, it "
        "would add the same gradient to .grad again)",
        "retain the graph only for a second, different loss through it: then pass retain_graph=True to every "
        "backward but the last"]
    torch.manual_seed(0)  # the loop as meant, by hand
    model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Tanh(), torch.nn.Flatten(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in torch.randn(3, 1, 4):
        model(x).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(seed000_loop(None), state(model)))
    assert not all(torch.equal(a, b) for a, b in zip(seed000_loop("retained"), state(model)))


def test_a_loss_without_a_graph_is_named_with_its_cause():
    model, opt, data = setup()
    guard = GraphGuard(model)
    with torch.no_grad():
        loss = model(data[0]).pow(2).mean()
    with pytest.raises(NoGraphError, match=r"\(step 1, loss 'loss'\): it does not depend on any tensor that requires "
                                           r"grad \(computed under no_grad"):
        guard.backward(loss)


def test_an_update_between_a_loss_and_its_backward_is_named():
    model, opt, data = setup()
    guard = GraphGuard(model, {"opt": opt}, check="always")
    with guard.step():
        first = model(model(data[0])).pow(2).mean()
        second = model(model(data[1])).pow(2).mean()  # its outer layer saves the weight for the inner's gradient
        guard.backward(first)
        opt.step()  # changes the weight `second`'s graph saved
        with pytest.raises(InplaceModificationError, match=r"optimizer 'opt'"):
            guard.backward(second)


def penalty_loop(stale: str, check: str, warmup: bool = False) -> None:
    """D's loss and update, then a second loss (a gradient penalty's place) through D's output, each step
    ended by the update: the output of this iteration, built before its update (StyleGAN2's lazy R1 as first
    written; ``stale="iteration"``), or the one kept from the last iteration (``"carried"``). ``warmup``: one
    backward and update before the loop, at a call site of its own."""
    torch.manual_seed(0)
    d = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 1))
    d_optim = torch.optim.SGD(d.parameters(), lr=0.1)
    guard = GraphGuard(d, {"d": d_optim}, check=check)
    if warmup:
        guard.backward(d(torch.ones(2, 4)).mean())
        d_optim.step()
    kept = None
    for x in setup()[2]:
        pred = d(x)  # the last layer saves its weight for the gradient of its input
        d_optim.zero_grad()
        guard.backward(F.softplus(-pred).mean(), retain_graph=True)
        d_optim.step()
        stale_pred = pred if stale == "iteration" else kept
        kept = pred
        if stale_pred is not None:
            d_optim.zero_grad()
            guard.backward(stale_pred.pow(2).mean())
            d_optim.step()


@pytest.mark.parametrize("warmup", [False, True], ids=["", "backward before the loop"])
@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_an_update_inside_the_iteration_is_named_as_such_and_a_graph_from_the_last_iteration_as_kept(check, warmup):
    """Steps end at each update: PyTorch's in-place error on the second loss is explained as the update between
    the loss and its backward, not as a graph kept across steps (what it is one iteration later); an iteration
    begins where the loop's first backward is called, also after a backward before the loop."""
    first, carried = (3, 4) if warmup else (2, 3)
    with pytest.raises(InplaceModificationError, match=re.escape(
            f"(step {first}, loss 'loss'): optimizer 'd' stepped after this loss was built and before its backward, "
            "changing parameters its graph saved ([torch.FloatTensor [8, 1]]). To fix: recompute the loss after "
            "the optimizer step (in a GAN: the generator loss from a fresh D(fake) after the discriminator step; "
            "a gradient penalty from a fresh D(real))")):
        penalty_loop("iteration", check, warmup)
    kept = (CarriedGraphError, rf"\(step {carried}, loss 'loss'\): the loss reaches AddmmBackward0, created during an "
            r"earlier step and held by `local stale_pred`") if check != "off" else \
        (InplaceModificationError, rf"\(step {carried}, loss 'loss'\): the loss reaches AddmmBackward0, built before "
         r"the step and held by `local stale_pred`.*a graph kept across steps goes stale")
    with pytest.raises(kept[0], match=kept[1]):
        penalty_loop("carried", check, warmup)


@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_a_graph_an_earlier_backward_of_the_iteration_freed_is_named_as_the_iterations(check):
    """DCGAN's D step on ``netD(fake)`` without ``.detach()``: D's backward frees the generator's graph, and G's
    loss after D's update goes through it. Steps end at each update, yet the graph is this iteration's, and the
    fix is the detach (or retain_graph), not detaching a carried state."""
    torch.manual_seed(0)
    g, d = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh()), torch.nn.Linear(4, 1)
    g_opt, d_opt = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    guard = GraphGuard(optimizers={"g": g_opt, "d": d_opt}, check=check)
    with pytest.raises(DoubleBackwardError, match=re.escape(
            "(step 2, loss 'loss'): the loss reaches TanhBackward0, made earlier in this loop iteration and held by "
            "`local fake`; an earlier backward of the iteration already freed its saved tensors") + ".*" + re.escape(
            "To fix: if one of the two losses must not reach it, detach it where that loss uses it (`fake.detach()`")):
        for real in torch.randn(3, 5, 4):
            fake = g(torch.randn(5, 2))
            d_opt.zero_grad()
            guard.backward(F.softplus(-d(real)).mean() + F.softplus(d(fake)).mean())  # meant: d(fake.detach())
            d_opt.step()
            g_opt.zero_grad()
            guard.backward(F.softplus(-d(fake)).mean())
            g_opt.step()


@pytest.mark.parametrize("check", ["always", "auto"])  # (off: explained after backward ran, and freed, `grad`)
def test_a_synthetic_gradient_modules_loss_through_the_freed_activation_is_told_to_detach_the_activation(check):
    """Decoupled neural interfaces (andrewliao11/dni.pytorch): layer 1 steps on the gradient a synthesizer predicts
    from its activation, `out.backward(grad.detach())`; the synthesizer then learns the true gradient. Fed `out`
    with its graph, its loss goes back through layer 1's freed graph. With `out` rebound to its detached copy, only
    `grad` (computed from it) names that graph: the fix detaches what `grad` is computed from, not `grad`, whose
    own graph trains the synthesizer. Fed `out.detach()`: quiet and trained as without the guard."""

    def dni(check=None, detached=True):
        torch.manual_seed(0)
        layer1, layer2, synth = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(4, 4)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (layer1, layer2, synth)]
        backward = GraphGuard(optimizers=opts, check=check).backward if check else torch.Tensor.backward
        for x in torch.randn(3, 5, 4):
            out = torch.tanh(layer1(x))
            grad = synth(out.detach() if detached else out)
            backward(out, grad.detach())
            opts[0].step()
            out = out.detach().requires_grad_()
            backward(layer2(out).pow(2).mean())
            opts[1].step()
            backward(F.mse_loss(grad, out.grad))
            opts[2].step()
            for opt in opts:
                opt.zero_grad()
        return [p for m in (layer1, layer2, synth) for p in m.parameters()]

    with pytest.raises(DoubleBackwardError, match=re.escape(
            "(step 3, loss 'loss'): the loss reaches TanhBackward0, made earlier in this loop iteration and held by "
            "`local grad`") + ".*" + re.escape("To fix: if one of the two losses must not reach it, detach what "
                                               "TanhBackward0 made where `grad` is computed from it (")):
        dni(check, detached=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = dni(check)
    assert all(torch.equal(a, b) for a, b in zip(ours, dni()))


def test_a_critics_loss_on_the_actors_features_inside_one_step_is_told_to_detach_them():
    """Dreamer's behaviour learning in one ``with guard.step()``: the actor's loss through imagined features steps
    the actor; the critic's loss on those features, not detached, reaches the actor's freed and now stale graph.
    Below them is no trained parameter but the actor's: detaching them where the critic uses them is a fix, beside a
    fresh forward. Fixed: quiet and trained as without the guard."""

    def dreamer(guard=None, detached=True):
        torch.manual_seed(0)
        actor, critic = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        actor_opt, critic_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (actor, critic))
        for x in torch.randn(3, 5, 4):
            with guard.step() if guard else nullcontext():
                feat = torch.tanh(actor(x))
                for opt, loss in ((actor_opt, -critic(feat).mean()),
                                  (critic_opt, critic(feat.detach() if detached else feat).pow(2).mean())):
                    opt.zero_grad()
                    guard.backward(loss) if guard else loss.backward()
                    opt.step()
        return [*actor.parameters(), *critic.parameters()]

    with pytest.raises(DoubleBackwardError, match=re.escape(
            "To fix: compute `feat` again after the change (a fresh forward) for this backward, so that its gradient is "
            "taken at the parameters as they are now; or if this loss must not reach it and is meant for its values as "
            "they were (a critic's loss on the actor's imagined features, a discriminator's loss on fakes made before "
            "the generator's update, as CycleGAN's), detach it where this loss uses it (`feat.detach()`)")):
        dreamer(GraphGuard(), detached=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = dreamer(GraphGuard())
    assert all(torch.equal(a, b) for a, b in zip(ours, dreamer()))


def test_a_list_of_losses_kept_across_steps_warns_once_naming_it_and_the_loss_variable_does_not():
    model, opt, data = setup()
    guard = GraphGuard(model, opt, check="always")
    history = []
    with pytest.warns(GraphLeakWarning, match=r"held by `local history\[\d\]`") as caught:
        for x in data:
            loss = model(x).pow(2).mean()
            guard.backward(loss)
            opt.step()
            opt.zero_grad()
            history.append(loss)
    assert len([w for w in caught if w.category is GraphLeakWarning]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, x in enumerate(data):  # `loss` holds the last step's graph until the next replaces it: no leak
            loss = model(x).pow(2).mean()
            guard.backward(loss)
            opt.step()
            if i % 3 == 0:  # nor does a variable replaced every few steps (a loss shown now and then)
                shown = loss
            opt.zero_grad()


def accumulating_loop(keep: str) -> None:
    """Two micro-batches per update, each loss divided by two before its backward (what Lightning's and
    Accelerate's gradient accumulation do); ``keep``: what the loop keeps of each micro-batch."""
    model, opt, data = setup()
    guard = GraphGuard(model, opt, check="always")
    running, last_out = 0.0, None
    for i, x in enumerate(data * 2):
        out = model(x)
        loss = out.pow(2).mean()
        if keep == "running":
            running = running + loss  # meant: loss.item()
        else:
            last_out = out  # replaced every micro-batch: one graph at a time
        guard.backward(loss / 2)
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()


def test_a_running_sum_of_losses_is_warned_about_when_the_loop_back_propagates_each_loss_divided():
    """The graphs kept are not those of the tensors back-propagated; keeping one graph at a time, or carrying a
    state on purpose (the carried check off), is no leak."""
    with pytest.warns(GraphLeakWarning, match=re.escape("the autograd graphs of both steps are still alive, held by "
                                                        "`local running`")):
        accumulating_loop("running")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accumulating_loop("last output")
        model, opt, data = setup()  # a state carried on purpose keeps several steps' graphs by design
        carry(GraphGuard(model, check="always", ignore=["carried"]), model, opt, data * 2, detach=False,
              retain_graph=True)


def test_an_ignored_check_lets_a_deliberate_carried_graph_through():
    model, opt, data = setup()
    carry(GraphGuard(model, ignore=["carried"]), model, opt, data[:3], detach=False, retain_graph=True)
    with pytest.raises(ConfigError, match=r"guard.ignore.*'carry'"):
        GraphGuard(model, ignore=["carry"])


def test_check_runs_the_pre_flight_for_a_backward_someone_else_calls(tmp_path):
    model, opt, data = setup()
    scale = model(torch.ones(1, 4)).sum()  # made at set-up, before the guard
    guard = GraphGuard(model, out_dir=tmp_path)
    loss = (model(data[0]) * scale).pow(2).mean()
    with pytest.raises(GraphReuseError, match="held by `local scale`") as info:
        guard.check(loss)  # as a Lightning on_before_backward hook or before accelerator.backward(loss) would
    assert info.value.picture is not None and Path(info.value.picture).exists()
    guard.check(F.mse_loss(model(data[1]), data[1]))  # a loss of its own graph passes
    out = model(data[2])
    guard.check({"mse": F.mse_loss(out, data[2]), "l1": out.abs().mean()})  # several named losses of one step
    with pytest.raises(GraphReuseError, match=r"loss 'reg'.*held by `local scale`"):
        guard.check({"mse": F.mse_loss(model(data[3]), data[3]), "reg": scale * 0.1})


def test_trace_turns_anomaly_mode_on_until_the_guard_is_closed():
    """Anomaly mode is the whole process's and slows every step: a guard done with it puts it back, once no
    other guard traces (one made again in a notebook's cell, the first left to the garbage collector)."""
    assert not torch.is_anomaly_enabled()
    model, opt, data = setup()
    scale = model(torch.ones(1, 4)).sum()  # built before the loop
    guard = GraphGuard(model, trace=True)
    assert torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()
    guard.close()
    assert not torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    with pytest.raises(GraphReuseError, match="pass trace=True to GraphGuard"):  # closed: it checks on, untraced
        guard.backward((model(data[0]) * scale).pow(2).mean())
    first, second = GraphGuard(model, trace=True), GraphGuard(model, trace=True)
    first.close()
    assert torch.is_anomaly_enabled()  # the second still traces
    third = GraphGuard(model, trace=True)
    del second
    gc.collect()
    third.close()
    assert not torch.is_anomaly_enabled()
    GraphGuard(model, trace=True)  # left to the garbage collector, never closed: on until a later guard closes
    gc.collect()
    assert torch.is_anomaly_enabled()
    GraphGuard(model, trace=True).close()
    assert not torch.is_anomaly_enabled()


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match=r"guard.check.*'sometimes'"):
        GraphGuard(check="sometimes")
    with pytest.raises(ConfigError, match=r"model must be a torch.nn.Module, got list"):
        GraphGuard([1])


class Accumulating(torch.optim.Optimizer):
    """A wrapper as accelerate's ``AcceleratedOptimizer``: it never runs ``Optimizer.__init__`` (so keeps no step
    hooks) and steps the optimizer it wraps every ``every`` calls."""

    def __init__(self, optimizer, every=2):
        self.optimizer, self.every, self.calls = optimizer, every, 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        self.calls += 1
        if self.calls % self.every == 0:
            self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        if self.calls % self.every == 0:
            self.optimizer.zero_grad(set_to_none)


def test_an_optimizer_wrapper_without_hooks_is_followed_through_the_optimizer_it_wraps():
    def train(guard):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = Accumulating(torch.optim.SGD(model.parameters(), lr=0.1))
        guard = guard(model, opt) if guard else None
        for i in range(6):
            x = torch.randn(3, 4)
            loss = model(x).pow(2).mean() / 2
            guard.backward(loss) if guard else loss.backward()
            opt.step()
            opt.zero_grad()
        return model
    ref, guarded = train(None), train(GraphGuard)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), guarded.parameters()))

    class Hookless(torch.optim.Optimizer):
        def __init__(self):
            """Never runs ``Optimizer.__init__`` and wraps no optimizer."""
    with pytest.raises(ConfigError, match=r"optimizers\['optimizer'\] \(Hookless\) keeps no step hooks .* pass the "
                                          r"optimizer it wraps"):
        GraphGuard(torch.nn.Linear(2, 2), Hookless())


def test_the_trainer_given_a_graph_guard_drives_the_same_guard():
    model, _, data = setup()
    guard = GraphGuard(check="always")
    trainer = Trainer(model=model, train_data=data, max_steps=2, device="cpu", progress=False, loggers=(),
                      guard=guard)
    assert trainer.guard is guard.guard


def test_messages_speak_of_the_loop_and_of_training_step_once_a_trainer_sets_its_words():
    """A Trainer handed a GraphGuard drives its engine, and sets the engine's words to its own."""
    model, _, data = setup()
    scale = model(torch.ones(1, 4)).sum()  # built before the guard
    guard = GraphGuard(model)
    assert guard.guard.words is LOOP and Guard().words is TRAINER
    with pytest.raises(GraphReuseError, match=r"built before the step \(before the loop\).*recompute `scale` "
                                              r"inside the loop.*pass trace=True to GraphGuard"):
        guard.check((model(data[0]) * scale).pow(2).mean())
    guard.guard.words = TRAINER
    with pytest.raises(GraphReuseError, match=r"built before the step \(in __init__, at module level or before fit\)"
                                              r".*recompute `scale` inside training_step.*set guard.trace=true"):
        guard.check((model(data[1]) * scale).pow(2).mean())


def several_optimizers_loop(data, carried: bool):
    """Four updates an iteration, by three optimizers, each ending a step (no ``guard.step()``), as soft
    actor-critic's: ``carried``: a recurrent state kept with its graph from one iteration to the next (a
    mistake); otherwise a value made after the last update of an iteration and used with its graph by
    the next iteration's third loss (SAC's ``alpha = log_alpha.exp()``, two steps later)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    log_scale = torch.zeros(1, requires_grad=True)
    opts = {"a": torch.optim.SGD(a.parameters(), lr=0.01), "b": torch.optim.SGD(b.parameters(), lr=0.01),
            "scale": torch.optim.SGD([log_scale], lr=0.01)}
    guard = GraphGuard(optimizers=opts, check="always")
    scale, h = torch.ones(1), torch.zeros(3, 4)  # a constant at first, as SAC's alpha
    for x in data:
        h = torch.tanh(a(x) + h) if carried else torch.tanh(a(x))
        first, second = h.pow(2).mean(), h.abs().mean()
        for loss in (first, second):  # two updates of a (SAC's two critic losses)
            opts["a"].zero_grad()
            guard.backward(loss, retain_graph=loss is first)
            opts["a"].step()
        guard.backward((scale * b(h.detach())).mean())
        opts["b"].step()
        opts["b"].zero_grad()
        opts["scale"].zero_grad()
        guard.backward(-(log_scale * 0.5).mean())
        opts["scale"].step()
        scale = log_scale.exp()  # with its graph, for the next iteration's third loss


def test_with_several_optimizers_a_value_from_the_last_iteration_is_fine_and_a_carried_state_is_not():
    data = setup()[2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        several_optimizers_loop(data, carried=False)
    with pytest.raises(CarriedGraphError, match=r"graph carried over from an earlier step .* held by `local h`"):
        several_optimizers_loop(data, carried=True)


class Forked(torch.nn.Module):
    """Members run with ``torch.jit.fork`` once scripted: in the inter-op thread pool."""

    def __init__(self):
        super().__init__()
        self.members = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        futures = [torch.jit.fork(member, x) for member in self.members]
        return torch.stack([torch.jit.wait(future) for future in futures]).sum(0)


def test_nodes_made_in_other_threads_are_not_taken_for_a_graph_built_before_the_loop():
    """Node numbers are per thread: after this thread made many nodes, the forked members' nodes carry
    numbers far below the loop's start. The loss variable holding them is the step's own."""
    w = torch.ones(1, requires_grad=True)
    for _ in range(5000):  # this thread's node counter moves on; the pool threads' do not
        w * 2
    model = torch.jit.script(Forked())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(optimizers=opt, check="always")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in setup()[2]:
            loss = model(x).pow(2).mean()
            guard.backward(loss)
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("check", ["always", "auto"])
@pytest.mark.parametrize("form", ["one step", "a step per peer", "a step per peer, a function per batch"])
def test_deep_mutual_learning_with_the_peers_output_not_detached_is_told_to_detach_it(check, form):
    """Deep mutual learning (chxy95/Deep-Mutual-Learning): each peer's loss is its cross-entropy plus the KL to the
    other's output, then its own zero_grad, backward and step. Without ``.detach()`` on the other's output, the first
    peer's backward runs (and frees) the second's graph, and the second's loss goes back through both: the fix names
    the second peer's output, which the first peer's update left as it was, and detaches it where the first loss uses
    it; not a fresh forward, nor the first peer's output, whose weights that update changed. One ``with guard.step()``
    around both updates, or steps ended by each update with the backward in a loop over the peers (each step of it the
    same iteration), there or in a function the batch loop calls. Detached: quiet, and trained bit for bit as without
    the guard."""

    def mutual(guard=None, detach=True):
        torch.manual_seed(0)
        peers = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)) for _ in range(2)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in peers]
        guard = guard(opts) if guard else None

        def train_batch(x, y):
            outputs = [m(x) for m in peers]
            for i in range(2):
                peer = outputs[1 - i].detach() if detach else outputs[1 - i]
                loss = F.cross_entropy(outputs[i], y) + F.kl_div(
                    F.log_softmax(outputs[i], 1), F.softmax(peer, 1), reduction="batchmean")
                opts[i].zero_grad()
                guard.backward(loss) if guard else loss.backward()
                opts[i].step()

        for x, y in zip(torch.randn(3, 6, 4), torch.randint(0, 3, (3, 6))):
            with guard.step() if guard and form == "one step" else nullcontext():
                if form.endswith("a function per batch"):
                    train_batch(x, y)
                    continue
                outputs = [m(x) for m in peers]
                for i in range(2):
                    peer = outputs[1 - i].detach() if detach else outputs[1 - i]
                    loss = F.cross_entropy(outputs[i], y) + F.kl_div(
                        F.log_softmax(outputs[i], 1), F.softmax(peer, 1), reduction="batchmean")
                    opts[i].zero_grad()
                    guard.backward(loss) if guard else loss.backward()
                    opts[i].step()
        return [p for m in peers for p in m.parameters()]

    def guarded(opts):
        return GraphGuard(check=check) if form == "one step" else GraphGuard(optimizers=opts, check=check)

    made = ("held by `local outputs[1]`, which the backward of 'loss'" if form == "one step" else
            "made earlier in this loop iteration and held by `local outputs[1]`")
    with pytest.raises(DoubleBackwardError, match=re.escape(made) + "(?!.*fresh forward).*" + re.escape(
            "detach it where that loss uses it (`outputs[1].detach()`")):
        mutual(guarded, detach=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = mutual(guarded)
    assert all(torch.equal(a, b) for a, b in zip(ours, mutual()))


def test_pseudo_labels_a_finished_teacher_made_with_their_graph_are_kept_without_it_not_made_again():
    """Noisy Student / pseudo-labelling: a teacher trained first, then soft pseudo-labels for the unlabelled set made
    once by it (meant under ``torch.no_grad()``), and a new student with an optimizer of its own trained on them. The
    teacher is no longer updated: its pseudo-labels are no stale cache to make again every step (what the fix said
    of a value made from a module the loop trained), but a constant to keep without its graph; so kept, the student
    trains bit for bit as with no_grad, and quietly."""

    def noisy_student(guard=None, keep="graph"):
        torch.manual_seed(0)
        teacher, student = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        labelled, unlabelled = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(2)], torch.randn(6, 4)
        step = guard.step if guard else nullcontext
        for model in (teacher, student):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if model is student:
                with torch.no_grad() if keep == "no_grad" else nullcontext():
                    pseudo = F.softmax(teacher(unlabelled), 1)
                pseudo = pseudo.detach() if keep == "detached" else pseudo
            for x, y in labelled:
                with step():
                    loss = F.cross_entropy(model(x), y)
                    if model is student:
                        loss = loss + F.kl_div(F.log_softmax(student(unlabelled), 1), pseudo, reduction="batchmean")
                    opt.zero_grad()
                    guard.backward(loss) if guard else loss.backward()
                    opt.step()
        return list(student.parameters())

    with pytest.raises(CarriedGraphError, match=re.escape("(step 4, loss 'loss'): the loss reaches SoftmaxBackward0, "
                                                          "created during an earlier step and held by `local pseudo`")
                       + ".*" + re.escape("To fix: keep it without its graph: it depends on no trained parameter (only "
                                          "on `teacher.weight`, `teacher.bias`)")):
        noisy_student(GraphGuard())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = noisy_student(GraphGuard(), keep="detached")
    assert all(torch.equal(a, b) for a, b in zip(kept, noisy_student(keep="no_grad")))


def test_optimizers_given_as_a_list_are_named_by_the_callers_variables():
    """SRGAN's step (leftthomas/SRGAN, train.py): the generator's loss built from the discriminator step's `fake_out`,
    back-propagated after `optimizerD.step()` changed the weights that graph saved. The optimizers, handed over as a
    list, are named as the loop names them (as watch does), not by their place in it."""
    torch.manual_seed(0)
    net_g, net_d = torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                                               torch.nn.Linear(4, 1))
    optimizerG = torch.optim.Adam(net_g.parameters())
    optimizerD = torch.optim.Adam(net_d.parameters())
    guard = GraphGuard(None, [optimizerG, optimizerD])
    with pytest.raises(InplaceModificationError, match="optimizer 'optimizerD' stepped after this loss was built"):
        for real in torch.randn(3, 4, 3):
            with guard.step():
                fake = net_g(torch.randn(4, 3))
                real_out, fake_out = net_d(real).mean(), net_d(fake).mean()
                optimizerD.zero_grad()
                guard.backward(1 - real_out + fake_out, retain_graph=True)
                optimizerD.step()
                optimizerG.zero_grad()
                guard.backward(1 - fake_out + fake.pow(2).mean())
                optimizerG.step()


def test_a_buffer_the_loop_writes_its_graph_into_in_place_does_not_move_the_first_steps_start():
    """Temporal ensembling's `outputs[i * bs:(i + 1) * bs] = out`, in a loop whose own `out` is made above the step:
    the buffer, made before the loop and written into in place by it (its graph is this step's), is no graph built
    before the loop that would make the step begin after it, so that `out` seemed built before the loop."""
    model, opt, data = setup()
    buf = torch.zeros(2, 3, 4)  # the last output and the latest
    guard = GraphGuard(model, opt)
    losses = []
    for x in data:
        out = model(x)
        buf[1] = out
        with guard.step():
            loss = (buf[1] - buf[0]).pow(2).mean()
            guard.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        buf.detach_()
        buf[0] = buf[1]
    assert len(losses) == len(data)



def test_a_state_carried_in_two_variables_is_detached_whole():
    """A differentiable simulator unrolled over time with truncated backprop, its `pos, vel` never detached."""
    model, opt, _ = setup()
    target = torch.ones(4)
    pos, vel = torch.zeros(4), torch.zeros(4)
    guard = GraphGuard(model, opt)
    with pytest.raises(CarriedGraphError, match=r"To fix: detach the carried state at the end of each step \(`("
                       + re.escape("pos = pos.detach(); vel = vel.detach()") + "|"
                       + re.escape("vel = vel.detach(); pos = pos.detach()") + ")`"):
        for _ in range(3):
            with guard.step():
                loss = 0
                for _ in range(3):
                    vel = vel + 0.1 * torch.tanh(model(torch.stack([pos, vel]).sum(0)))
                    pos = pos + 0.1 * vel
                    loss = loss + (pos - target).pow(2).sum()
                guard.backward(loss)
                opt.step()
                opt.zero_grad()


def test_a_kept_rollout_whose_saved_weights_an_update_changed_is_a_carried_graph_not_a_loss_built_before_the_update():
    """Values kept with their graph from one rollout (OpenRLHF's make_experience without no_grad) and compared with,
    one per update: the second one's graph saved weights that the first update changed. Said before its backward as
    a graph carried over whose saved tensors changed, naming the buffer, with the fix for a target; not as an
    optimizer step between this loss's forward and its backward (the loss was built after it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt, guard = torch.optim.SGD(model.parameters(), lr=0.1), GraphGuard(model)

    def update(old):
        with guard.step():
            loss = (model(torch.randn(3, 4)) - old).pow(2).mean()
            guard.backward(loss)
            opt.step()
            opt.zero_grad()

    update(torch.zeros(3, 1))
    buffer = [model(torch.randn(3, 4)) for _ in range(2)]
    update(buffer[0])  # the first backward through a value made since the last step: a one-step lag, fine
    before = state(model)
    with pytest.raises(CarriedGraphError, match=re.escape("(step 3, loss 'loss'): the loss reaches ") + r".*held by "
                       r"`local old`; a tensor its graph saved was changed in place since it was made.*To fix: "
                       r"if it is a target the loss compares with.*compute it under `torch.no_grad\(\)`"):
        update(buffer[1])
    assert all(torch.equal(a, b) for a, b in zip(before, state(model)))
