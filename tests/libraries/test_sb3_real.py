"""stable-baselines3 2.9's algorithms (with gymnasium 1.4's classic-control environments), trained by their own
``model.learn()``: PPO and A2C on CartPole-v1 (a rollout buffer read by several epochs of minibatches, normalized
advantages, ``clip_grad_norm_``), DQN on CartPole-v1 (a target network copied by ``polyak_update`` under
``no_grad``, ``train_freq=1``), SAC on Pendulum-v1 with ``ent_coef="auto"`` (``log_ent_coef`` and its own
optimizer, ``th.exp(self.log_ent_coef.detach())``, an actor loss through the ``log_prob`` made before the entropy
and critic updates; once more with a features extractor shared by actor and critic, which SB3 runs under
``set_grad_enabled(False)`` in the critic) and TD3 on Pendulum-v1 (delayed actor updates). SB3 runs its gradient
loop in the algorithm's ``train()``, called by ``learn()`` between rollouts.

Each runs three ways from the same seed (``seed=0``, ``device="cpu"``): bare; under ``python -m safeloop.watch``'s
guard (``Watch``, in process, this file being the user's script: every backward SB3 calls goes through it, every
optimizer step ends a step, nothing asked of the user); and with a ``safeloop.GraphGuard`` where an SB3 user puts
one. The policy's parameters and buffers, every optimizer's state (``policy.optimizer``; ``actor``'s and
``critic``'s; ``ent_coef_optimizer``), ``log_ent_coef`` and what SB3 logged (each ``logger.dump`` and what
``train()`` recorded before each rollout, wall times left out) must come out bit for bit the same, with no warning
the bare run does not emit. A script that calls ``model.learn(..., reset_num_timesteps=False)`` several times runs
the same under ``watch``.

Where the ``GraphGuard`` goes: SB3 hands a user no loss (the losses are ``train()``'s locals; callbacks see
rollouts, not gradient steps). So an algorithm subclass (``Guarded``) makes ``GraphGuard(self.policy,
{optimizer name: optimizer})`` at its first ``train()``, after the policy and its features extractor are built, and
runs ``super().train()`` inside a ``torch.overrides.TorchFunctionMode`` (``Backwards``) that sends each
``Tensor.backward`` to ``guard.backward``; no SB3 method is patched. A step ends at each optimizer's step. What it
checks there: every backward of ``train()`` before it runs (a graph built before training, carried across gradient
steps or kept after them, a loss already back-propagated), names a tensor as an attribute of ``model`` (the policy)
and knows the trained parameters from the optimizers. What it cannot: a backward outside ``train()`` (none in SB3);
the losses' own names (every loss is ``loss``, SB3's locals are not searched: only ``model`` and the variables of
this file's running frames are); a graph made during a rollout (SB3 collects under ``no_grad``); and since SB3's
policy builds its optimizers, the guard is made at the first ``train()``, after the first rollout, not before
``learn()``. No ``safeloop.Trainer`` port: SB3's loop interleaves environment steps, replay and rollout buffers with
its updates, and a port would be a copy of ``train()``, not SB3's own code.

Under ``watch`` two guard findings came from these loops (both fixed, each reproduced in plain torch in
``tests/watch/scripts/``): SB3 keeps each network's optimizer on the network (``actor.optimizer``), so watch counted
one optimizer to come and took SAC's first actor loss, through the sample made before the entropy and critic
updates, for a carried graph (``sac_optimizers_on_modules.py``); and with no module or optimizer in the script's
variables (only the algorithm), no parameter was known as trained, so a cache made from one was advised kept
detached (``rotary_cache_in_agent.py``). A graph built in a features extractor's ``__init__`` is still seen under
watch at step 2, as carried, not at step 1 (a strict xfail).

Then the mistakes of SB3 users (custom features extractors and policies: SB3 issues #981, #1501, #425, #691): a
learned scale computed once in a features extractor's ``__init__`` and used by every forward; a running statistic
kept with its graph across forwards; an extractor keeping its outputs in a list; a policy summing its values with
their graphs in ``evaluate_actions``. Each is stopped before the update it would corrupt, or warned, naming the
attribute; the advised fix trains quiet and bit for bit alike in the three runs. The docs' ``CustomCNN`` pattern of
running the network once in ``__init__`` for ``n_flatten`` (users drop the ``no_grad``) stays quiet.
"""
import warnings

import pytest
import torch
import torch.nn as nn

LIB = pytest.importorskip("stable_baselines3")
pytest.importorskip("gymnasium")

from stable_baselines3 import A2C, DQN, PPO, SAC, TD3  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.logger import KVWriter, Logger  # noqa: E402
from stable_baselines3.common.policies import ActorCriticPolicy  # noqa: E402
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor  # noqa: E402

from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import CarriedGraphError, GraphLeakWarning, GraphReuseError  # noqa: E402
from safeloop.watch import Watch  # noqa: E402
from tests.libraries.compare import Backwards, same  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402


# -- the guard where an SB3 user puts it ---------------------------------------------------------------------------
OPTIMIZERS = (("policy", "optimizer"), ("actor", "optimizer"), ("critic", "optimizer"), (None, "ent_coef_optimizer"))


def optimizers(algo):
    """Every optimizer SB3 steps in ``algo.train()``, by name (DQN's and PPO's ``policy.optimizer``; SAC's and TD3's
    ``actor.optimizer``, ``critic.optimizer``; SAC's ``ent_coef_optimizer``)."""
    found = {}
    for owner, name in OPTIMIZERS:
        holder = algo if owner is None else getattr(algo, owner, None)
        opt = getattr(holder, name, None)
        if isinstance(opt, torch.optim.Optimizer) and all(opt is not o for o in found.values()):
            found[name if owner is None else f"{owner}.{name}"] = opt
    return found


class Guarded:
    """An algorithm whose ``train()`` runs under a ``GraphGuard`` (``guard_check``: its ``check``; None: SB3's
    ``train()`` as it is), made at the first ``train()``."""

    def __init__(self, *args, guard_check=None, **kwargs):
        self.guard_check, self.graph_guard = guard_check, None
        super().__init__(*args, **kwargs)

    def train(self, *args, **kwargs):
        if self.guard_check is None:
            return super().train(*args, **kwargs)
        if self.graph_guard is None:
            self.graph_guard = GraphGuard(self.policy, optimizers(self), check=self.guard_check)
        with Backwards(self.graph_guard):
            return super().train(*args, **kwargs)


GUARDED = {cls: type(f"Guarded{cls.__name__}", (Guarded, cls), {}) for cls in (PPO, A2C, DQN, SAC, TD3)}


# -- what SB3 records ----------------------------------------------------------------------------------------------
class Dumps(KVWriter):
    """Each ``logger.dump``'s values (wall times left out)."""

    def __init__(self):
        self.rows = []

    def write(self, key_values, key_excluded, step=0):
        self.rows.append((step, {k: v for k, v in key_values.items() if not k.startswith("time/")}))

    def close(self):
        """Nothing to close: the rows stay in memory."""


class Recorded(BaseCallback):
    """What ``train()`` recorded, read at each rollout's start (off-policy algorithms dump only at episode ends)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def _on_rollout_start(self):
        self.rows.append({k: v for k, v in self.logger.name_to_value.items() if not k.startswith("time/")})

    def _on_step(self):
        return True


def result(algo, dumps, recorded):
    """What a run ends with: the policy, every optimizer's state, ``log_ent_coef``, what SB3 logged."""
    out = {"policy": algo.policy, **{name: opt.state_dict() for name, opt in optimizers(algo).items()},
           "dumps": dumps.rows, "recorded": recorded.rows, "n_updates": algo._n_updates}
    if getattr(algo, "log_ent_coef", None) is not None:
        out["log_ent_coef"] = algo.log_ent_coef
    return out


def fit(cls, env, steps, guard_check=None, learns=1, **kwargs):
    """``cls("MlpPolicy", env, seed=0, device="cpu", ...)`` (the ``Guarded`` subclass with a ``guard_check``) learning
    ``steps`` timesteps, ``learns`` times with ``reset_num_timesteps=False`` after the first; returns its result."""
    kwargs.setdefault("policy", "MlpPolicy")
    kwargs["policy_kwargs"] = {"net_arch": [16], **kwargs.get("policy_kwargs", {})}
    algo = (cls if guard_check is None else GUARDED[cls])(
        env=env, seed=0, device="cpu", **kwargs, **({} if guard_check is None else {"guard_check": guard_check}))
    dumps, recorded = Dumps(), Recorded()
    algo.set_logger(Logger(folder=None, output_formats=[dumps]))
    for i in range(learns):
        algo.learn(steps, callback=recorded, log_interval=1, reset_num_timesteps=i == 0)
    return result(algo, dumps, recorded)


def fresh_policy(cls, env, **kwargs):
    """The policy ``fit`` starts from (built from the same seed, untrained)."""
    kwargs.setdefault("policy", "MlpPolicy")
    kwargs["policy_kwargs"] = {"net_arch": [16], **kwargs.get("policy_kwargs", {})}
    return cls(env=env, seed=0, device="cpu", **kwargs).policy


def three_runs(cls, env, steps, check, learns=1, **kwargs):
    """``fit`` bare, under ``Watch`` (this file as the script) and with the ``Guarded`` subclass's
    ``GraphGuard(check=check)``: every result bit for bit the bare run's, no warning the bare run lacks; the policy
    trained. Returns the bare run's result."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = fit(cls, env, steps, learns=learns, **kwargs)
    with strict(own), Watch(GraphGuard(check=check), __file__):
        watched = fit(cls, env, steps, learns=learns, **kwargs)
    same(watched, ref, "watched")
    with strict(own):
        guarded = fit(cls, env, steps, guard_check=check, learns=learns, **kwargs)
    same(guarded, ref, "guarded")
    start = fresh_policy(cls, env, **kwargs).state_dict()
    assert any(not torch.equal(p, start[k]) for k, p in ref["policy"].state_dict().items()), "nothing trained"
    return ref


# -- the correct loops ---------------------------------------------------------------------------------------------
class Linear(BaseFeaturesExtractor):
    """A features extractor with weights (``Linear`` + ReLU)."""

    def __init__(self, observation_space, features_dim=8):
        super().__init__(observation_space, features_dim)
        self.linear = nn.Linear(observation_space.shape[0], features_dim)

    def forward(self, observations):
        return torch.relu(self.linear(observations))


LOOPS = {
    "ppo": (PPO, "CartPole-v1", 64, {"n_steps": 32, "batch_size": 16, "n_epochs": 2}),
    "a2c": (A2C, "CartPole-v1", 50, {"n_steps": 5}),
    "dqn": (DQN, "CartPole-v1", 48, {"learning_starts": 16, "train_freq": 1, "batch_size": 8,
                                     "target_update_interval": 5, "buffer_size": 500}),
    "sac": (SAC, "Pendulum-v1", 48, {"learning_starts": 16, "batch_size": 8, "buffer_size": 500, "ent_coef": "auto"}),
    "sac_shared_extractor": (SAC, "Pendulum-v1", 40, {
        "learning_starts": 16, "batch_size": 8, "buffer_size": 500, "ent_coef": "auto",
        "policy_kwargs": {"features_extractor_class": Linear, "share_features_extractor": True}}),
    "td3": (TD3, "Pendulum-v1", 48, {"learning_starts": 16, "batch_size": 8, "buffer_size": 500, "policy_delay": 2}),
}


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("check", checks())
def test_sb3_learn_is_the_same_bare_watched_and_guarded(check, loop):
    """Each algorithm's ``learn()``: the policy, every optimizer's state, ``log_ent_coef`` and SB3's logs bit for bit
    alike, quiet; SB3's own patterns (target networks by ``polyak_update`` under ``no_grad``, the detached
    ``log_ent_coef``, ``clip_grad_norm_``, normalized advantages, one rollout buffer read by several epochs, SAC's
    shared extractor run without grad in the critic) raise nothing."""
    cls, env, steps, kwargs = LOOPS[loop]
    ref = three_runs(cls, env, steps, check, **kwargs)
    logged = [row for _, row in ref["dumps"]] + ref["recorded"]
    assert ref["n_updates"] > 0 and any("train/n_updates" in row for row in logged)
    if cls is SAC:
        assert ref["log_ent_coef"].item() != 0.0  # the entropy coefficient's optimizer stepped


@pytest.mark.parametrize("check", checks())
def test_a_script_calling_learn_several_times_is_the_same_under_watch(check):
    """``model.learn(64, reset_num_timesteps=False)`` three times, as a script continuing a run does."""
    ref = three_runs(PPO, "CartPole-v1", 32, check, learns=3, n_steps=32, batch_size=16, n_epochs=2)
    assert ref["n_updates"] == 6


# -- the mistakes --------------------------------------------------------------------------------------------------
PPO_KW = {"n_steps": 32, "batch_size": 16, "n_epochs": 2}


class Scaled(BaseFeaturesExtractor):
    """A learned per-feature scale: ``self.scale = self.log_scale.exp()`` once in ``__init__`` (the mistake: one graph
    for every gradient step), or ``fix``: ``self.log_scale.exp()`` in ``forward``."""

    def __init__(self, observation_space, fix=False):
        super().__init__(observation_space, observation_space.shape[0])
        self.log_scale = nn.Parameter(torch.zeros(observation_space.shape[0]))
        self.fix = fix
        if not fix:
            self.scale = self.log_scale.exp()

    def forward(self, observations):
        return observations * (self.log_scale.exp() if self.fix else self.scale)


class Running(BaseFeaturesExtractor):
    """A running mean of the features subtracted from them: kept with its graph (the mistake), or ``fix``: detached
    once updated, as BatchNorm keeps its statistics."""

    def __init__(self, observation_space, fix=False):
        super().__init__(observation_space, 8)
        self.linear = nn.Linear(observation_space.shape[0], 8)
        self.fix = fix
        self.running = torch.zeros(8)

    def forward(self, observations):
        h = torch.relu(self.linear(observations))
        self.running = 0.9 * self.running + 0.1 * h.mean(0)
        if self.fix:
            self.running = self.running.detach()
        return h - self.running


class Kept(BaseFeaturesExtractor):
    """Every output kept in a list for a later look: with its graph (the mistake), or ``fix``: detached."""

    def __init__(self, observation_space, fix=False):
        super().__init__(observation_space, 8)
        self.linear = nn.Linear(observation_space.shape[0], 8)
        self.fix = fix
        self.outputs = []

    def forward(self, observations):
        h = torch.relu(self.linear(observations))
        self.outputs.append(h.detach() if self.fix else h)
        return h


class Summing(ActorCriticPolicy):
    """A policy summing the values ``evaluate_actions`` gives ``train()``: with their graphs (the mistake), or
    ``fix``: ``.item()``."""

    fix = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.value_total = 0.0

    def evaluate_actions(self, obs, actions):
        values, log_prob, entropy = super().evaluate_actions(obs, actions)
        self.value_total = self.value_total + (values.mean().item() if self.fix else values.mean())
        return values, log_prob, entropy


class SummingFixed(Summing):
    fix = True


class Probed(BaseFeaturesExtractor):
    """SB3's docs' ``CustomCNN``: the network run once in ``__init__`` on a sampled observation to read its output
    size, here without the docs' ``th.no_grad()`` (only ``.shape`` is kept: no graph outlives ``__init__``)."""

    def __init__(self, observation_space, features_dim=8):
        super().__init__(observation_space, features_dim)
        self.body = nn.Sequential(nn.Linear(observation_space.shape[0], 12), nn.ReLU())
        n_flatten = self.body(torch.as_tensor(observation_space.sample()[None]).float()).shape[1]
        self.linear = nn.Sequential(nn.Linear(n_flatten, features_dim), nn.ReLU())

    def forward(self, observations):
        return self.linear(self.body(observations))


def extractor(cls, fix=False):
    return {"policy_kwargs": {"features_extractor_class": cls, "features_extractor_kwargs": {"fix": fix}}}


def stopped(pattern, error, **kwargs):
    """PPO with ``kwargs`` is stopped by ``error`` matching ``pattern`` under a ``GraphGuard``, before any update."""
    with pytest.raises(error, match=pattern):
        fit(PPO, "CartPole-v1", 64, guard_check="always", **PPO_KW, **kwargs)


def test_a_scale_computed_in_the_extractors_init_is_stopped_at_the_first_step():
    """``self.scale = self.log_scale.exp()`` in ``__init__``: bare, SB3's second minibatch fails mid-backward
    ('backward through the graph a second time'); the guard stops the first, before any gradient or update, naming
    ``model.features_extractor.scale`` and advising to compute it each step."""
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        fit(PPO, "CartPole-v1", 64, **PPO_KW, **extractor(Scaled))
    algo = GUARDED[PPO]("MlpPolicy", "CartPole-v1", seed=0, device="cpu", guard_check="always",
                        policy_kwargs={"net_arch": [16], **extractor(Scaled)["policy_kwargs"]}, **PPO_KW)
    start = {k: v.clone() for k, v in algo.policy.state_dict().items()}
    with pytest.raises(GraphReuseError, match=r"step 1, .*ExpBackward0, built before the step .*held by "
                                              r"`model\.features_extractor\.scale`.*To fix: recompute "
                                              r"`model\.features_extractor\.scale` inside the loop"):
        algo.learn(64)
    same(algo.policy.state_dict(), start)
    assert all(p.grad is None for p in algo.policy.parameters())


def test_a_scale_computed_in_the_extractors_init_is_stopped_under_watch():
    """Under ``watch`` it is stopped at step 2, before that backward (see the xfail below), naming the attribute and
    advising to make it again each step: it is made from a trained parameter, so not to keep it detached."""
    with Watch(GraphGuard(check="always"), __file__), \
            pytest.raises(CarriedGraphError, match=r"step 2, .*held by `algo\.policy\.features_extractor\.scale`.*"
                                                   r"To fix: make `algo\.policy\.features_extractor\.scale` again "
                                                   r"every step instead of keeping it"):
        algo = PPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu", **PPO_KW,
                   policy_kwargs={"net_arch": [16], **extractor(Scaled)["policy_kwargs"]})
        algo.learn(64)


@pytest.mark.xfail(strict=True, raises=CarriedGraphError, reason="under watch the first step starts after the "
                   "graphs the script's variables hold before `algo.learn` (watch.loop_start), two levels deep: "
                   "`algo` is no module, `algo.policy` is, but the attributes of its submodules "
                   "(`algo.policy.features_extractor.scale`) are not searched, so the graph built in __init__ is taken "
                   "for step 1's own and reported at step 2 as carried")
def test_a_scale_computed_in_the_extractors_init_is_stopped_at_the_first_step_under_watch():
    with Watch(GraphGuard(check="always"), __file__), pytest.raises(GraphReuseError, match=r"step 1, "):
        algo = PPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu", **PPO_KW,
                   policy_kwargs={"net_arch": [16], **extractor(Scaled)["policy_kwargs"]})
        algo.learn(64)


def test_a_running_statistic_kept_with_its_graph_is_stopped_at_the_second_step():
    """A running mean with its graph: bare, SB3's second minibatch fails mid-backward; the guard and ``watch`` stop
    it before that backward, naming ``running`` and advising its detach."""
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        fit(PPO, "CartPole-v1", 64, **PPO_KW, **extractor(Running))
    stopped(r"step 2, .*held by `model\.features_extractor\.running`.*To fix: detach the carried state.*"
            r"`model\.features_extractor\.running = model\.features_extractor\.running\.detach\(\)`",
            CarriedGraphError, **extractor(Running))
    with Watch(GraphGuard(check="always"), __file__), \
            pytest.raises(CarriedGraphError, match=r"step 2, .*held by `[\w.]*features_extractor\.running`.*"
                                                   r"\.running\.detach\(\)"):
        fit(PPO, "CartPole-v1", 64, **PPO_KW, **extractor(Running))


def test_outputs_kept_by_the_extractor_are_warned():
    """An extractor appending its outputs to a list: a ``GraphLeakWarning`` naming the list and advising the detach
    where they are appended, with the guard and under ``watch``."""
    pattern = r"held by `[\w.]*features_extractor\.outputs\[\d+\]`.*To fix: detach what is added to " \
              r"`[\w.]*features_extractor\.outputs` where it is added"
    with pytest.warns(GraphLeakWarning, match=pattern):
        fit(PPO, "CartPole-v1", 64, guard_check="always", **PPO_KW, **extractor(Kept))
    with Watch(GraphGuard(check="always"), __file__), pytest.warns(GraphLeakWarning, match=pattern):
        fit(PPO, "CartPole-v1", 64, **PPO_KW, **extractor(Kept))


def test_values_summed_with_their_graphs_by_the_policy_are_warned():
    """``self.value_total = self.value_total + values.mean()`` in ``evaluate_actions``: a ``GraphLeakWarning`` naming
    ``value_total``, advising ``.item()``, with the guard and under ``watch``."""
    pattern = r"held by `[\w.]*value_total`.*Store loss\.item\(\) or loss\.detach\(\)"
    with pytest.warns(GraphLeakWarning, match=pattern):
        fit(PPO, "CartPole-v1", 64, guard_check="always", policy=Summing, **PPO_KW)
    with Watch(GraphGuard(check="always"), __file__), pytest.warns(GraphLeakWarning, match=pattern):
        fit(PPO, "CartPole-v1", 64, policy=Summing, **PPO_KW)


FIXED = {
    "scale_in_forward": extractor(Scaled, fix=True),
    "running_detached": extractor(Running, fix=True),
    "outputs_detached": extractor(Kept, fix=True),
    "values_item": {"policy": SummingFixed},
    "probed_in_init": {"policy_kwargs": {"features_extractor_class": Probed}},
}


@pytest.mark.parametrize("fixed", list(FIXED))
def test_the_advised_fixes_train_quiet(fixed):
    """Each advised fix (and the docs' ``CustomCNN`` probe without ``no_grad``) trains quiet, bit for bit alike bare,
    watched and guarded."""
    ref = three_runs(PPO, "CartPole-v1", 64, "always", **PPO_KW, **FIXED[fixed])
    if fixed == "scale_in_forward":
        assert not torch.equal(ref["policy"].features_extractor.log_scale, torch.zeros(4))  # the scale trained
