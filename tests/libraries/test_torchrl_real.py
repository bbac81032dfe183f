"""TorchRL 0.14's own training loops (tensordict 0.14, gymnasium 1.4's Pendulum-v1 and CartPole-v1 through
``torchrl.envs.GymEnv``), run from the same seeds:

- the PPO tutorial's loop (``Collector``, ``GAE``, ``ClipPPOLoss``, a ``ReplayBuffer`` with a
  ``SamplerWithoutReplacement`` refilled each epoch, several epochs over each collected batch, ``clip_grad_norm_``,
  ``optim.step()`` / ``optim.zero_grad()``, a cosine schedule);
- DQN (``DQNLoss`` with a target network, ``SoftUpdate`` or ``HardUpdate``, an ``EGreedyModule`` annealed each step,
  a replay buffer filled by the collector);
- SAC (``SACLoss`` with two Q-nets and their target, ``loss_actor``, ``loss_qvalue`` and ``loss_alpha``): summed
  under one optimizer, and back-propagated one by one into three optimizers; DDPG (``DDPGLoss``, two optimizers).

Each runs bare, under ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script)
and with a ``safeloop.GraphGuard`` where a TorchRL user puts one (``GraphGuard(loss_module, optimizers)``, a ``with
guard.step():`` around each update, ``guard.backward(loss)``). Every parameter and buffer of the loss module (the
target networks' parameters are its buffers), each optimizer's state, the target parameters and the logged losses
come out bit for bit the same, with no warning the bare run does not emit.

Then the mistakes of TorchRL users (pytorch/rl#1225 moved the examples' GAE under ``torch.no_grad()``; MAPPO's
advantages kept with their graph across mini-epochs, hijkzzz/pymarl2#46): the critic's values and TorchRL's functional
``generalized_advantage_estimate`` run with grad (``GAE`` itself holds the critic out), so the replay buffer stores
the value target with the critic's graph; each ``loss_vals`` TensorDict kept with its graphs in a history list; the
loss terms of one ``loss_vals`` back-propagated one by one through the actor's shared distribution. Each is stopped or
warned, naming the key, and the advised fix trains quiet (a strict xfail: the watch's diagnosis of the terms
back-propagated one by one before any optimizer step). A target network that is
the online one (``delay_value=False``) is refused by TorchRL's ``SoftUpdate`` itself.

Under ``watch``, SAC with its three optimizers kept in a dict (``optims[name].step()``) was a false alarm, fixed in
``safeloop/watch.py`` (``tests/watch/scripts/sac_optimizers_in_a_dict.py``).
"""
import contextlib
import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchrl")
pytest.importorskip("gymnasium")

from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement  # noqa: E402
from torchrl.envs import Compose, DoubleToFloat, GymEnv, StepCounter, TransformedEnv  # noqa: E402
from torchrl.modules import (EGreedyModule, MLP, ProbabilisticActor, QValueModule, TanhNormal,  # noqa: E402
                             ValueOperator)
from torchrl.objectives import ClipPPOLoss, DDPGLoss, DQNLoss, HardUpdate, SACLoss, SoftUpdate  # noqa: E402
from torchrl.objectives.value import GAE  # noqa: E402
from torchrl.objectives.value.functional import generalized_advantage_estimate  # noqa: E402

from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import CarriedGraphError, DoubleBackwardError, GraphLeakWarning, GraphReuseError  # noqa: E402
from safeloop.watch import Watch  # noqa: E402
from tests.libraries.compare import same  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402


# -- what every case runs ------------------------------------------------------------------------------------------
def make_env(name):
    """``GymEnv(name)`` with TorchRL's usual transforms, seeded."""
    env = TransformedEnv(GymEnv(name, device="cpu"), Compose(DoubleToFloat(), StepCounter()))
    env.set_seed(0)
    return env


def collector(env, policy, frames, total, **kwargs):
    """TorchRL's single-process ``Collector`` (``SyncDataCollector`` before 0.14)."""
    return Collector(env, policy, frames_per_batch=frames, total_frames=total, split_trajs=False, device="cpu",
                     auto_register_policy_transforms=False, **kwargs)


def stepped(guard):
    return guard.step() if guard is not None else contextlib.nullcontext()


def backward(loss, guard, **kwargs):
    """``loss.backward(**kwargs)``, or the guard's."""
    guard.backward(loss, **kwargs) if guard is not None else loss.backward(**kwargs)


def three_runs(build, train, check):
    """``train(*build(), guard=...)`` bare, under ``Watch`` (this file as the script) and with a
    ``GraphGuard(loss_module, optimizers, check=check)`` made by ``train`` (``guard=check``), each from
    ``torch.manual_seed(0)``: what each returns is the bare run's, bit for bit, with no warning the bare run lacks;
    the loss module trained. Returns the bare run's result."""
    def run(guard=None):
        torch.manual_seed(0)
        built = build()
        start = {k: v.clone() for k, v in built[0].state_dict().items()}
        return train(*built, guard=guard), start
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref, start = run()
    with strict(own), Watch(GraphGuard(check=check), __file__):
        watched, _ = run()
    same(watched, ref, "watched")
    with strict(own):
        guarded, _ = run(guard=check)
    same(guarded, ref, "guarded")
    trained = ref["loss_module"].state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in start.items()), "nothing trained"
    return ref


def guard_for(check, loss_module, optimizers):
    """Where a TorchRL user makes the guard: the loss module (every network it trains) and its optimizers."""
    return None if check is None else GraphGuard(loss_module, optimizers, check=check)


# == PPO ============================================================================================================
def ppo_build():
    """The PPO tutorial's modules on Pendulum-v1, tiny: a ``TanhNormal`` actor, a value net, ``GAE``,
    ``ClipPPOLoss``."""
    env = make_env("Pendulum-v1")
    actor_net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2), NormalParamExtractor())
    policy = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]), spec=env.action_spec,
        in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True,
        distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high})
    value = ValueOperator(nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)), in_keys=["observation"])
    advantage = GAE(gamma=0.99, lmbda=0.95, value_network=value, average_gae=True)
    loss_module = ClipPPOLoss(actor_network=policy, critic_network=value, clip_epsilon=0.2, entropy_bonus=True,
                              entropy_coeff=1e-4, critic_coeff=1.0, loss_critic_type="smooth_l1")
    return loss_module, env, policy, advantage


def gae_by_hand(value, data, gamma=0.99, lmbda=0.95):
    """The advantage and value target by TorchRL's functional GAE on the critic's values of ``data`` and of its
    ``"next"`` (what ``GAE`` does, without its ``hold_out_net``)."""
    value(data)
    value(data["next"])
    adv, target = generalized_advantage_estimate(gamma, lmbda, data["state_value"], data["next", "state_value"],
                                                 data["next", "reward"], data["next", "done"],
                                                 data["next", "terminated"])
    data["advantage"], data["value_target"] = adv, target


def ppo_loop(loss_module, env, policy, advantage, guard=None, frames=32, total=96, epochs=2, sub=16, fix=None,
             log_graphs=False, by_hand=False, split=False):
    """The PPO tutorial's loop: for each collected batch, ``epochs`` times: the advantage (``GAE``) recomputed, the
    batch put in the replay buffer, ``frames // sub`` minibatch updates, each ``loss_vals`` kept detached in a history.
    The mistakes: ``by_hand``, the advantage by ``gae_by_hand`` with grad (``fix="no_grad"``: under
    ``torch.no_grad()``); ``split``, the loss terms back-propagated one by one (``fix="retain"``: the objective's
    backward with ``retain_graph=True``); ``log_graphs``, each ``loss_vals`` kept as it is (the fix:
    ``loss_vals.detach()``)."""
    optim = torch.optim.Adam(loss_module.parameters(), 3e-3)
    guard = guard_for(guard, loss_module, optim)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optim, total // frames, 0.0)
    buffer = ReplayBuffer(storage=LazyTensorStorage(frames), sampler=SamplerWithoutReplacement())
    logs, history = {"loss": [], "reward": [], "lr": []}, []
    for data in collector(env, policy, frames, total):
        for _ in range(epochs):
            if by_hand:
                with torch.no_grad() if fix == "no_grad" else contextlib.nullcontext():
                    gae_by_hand(loss_module.critic_network, data)
            else:
                advantage(data)
            buffer.extend(data.reshape(-1))
            for _ in range(frames // sub):
                with stepped(guard):
                    loss_vals = loss_module(buffer.sample(sub))
                    loss = loss_vals["loss_objective"] + loss_vals["loss_critic"] + loss_vals["loss_entropy"]
                    if split:  # the terms one by one: the objective and the entropy share the actor's distribution
                        for term in ("loss_objective", "loss_entropy", "loss_critic"):
                            backward(loss_vals[term], guard, retain_graph=fix == "retain" and term == "loss_objective")
                    else:
                        backward(loss, guard)
                    torch.nn.utils.clip_grad_norm_(loss_module.parameters(), 1.0)
                    optim.step()
                    optim.zero_grad()
                history.append(loss_vals if log_graphs else loss_vals.detach())
                logs["loss"].append(loss.item())
        logs["reward"].append(data["next", "reward"].mean().item())
        logs["lr"].append(optim.param_groups[0]["lr"])
        scheduler.step()
    return {"loss_module": loss_module, "optim": optim.state_dict(), "logs": logs,
            "history": [dict(td.items()) for td in history]}


@pytest.mark.parametrize("check", checks())
def test_ppo_tutorial_loop_is_the_same_bare_watched_and_guarded(check):
    """The PPO tutorial's loop: actor and critic, Adam's state, the losses, rewards and rates logged, and every
    ``loss_vals`` (detached) bit for bit alike; quiet."""
    ref = three_runs(ppo_build, ppo_loop, check)
    assert len(ref["logs"]["loss"]) == 3 * 2 * 2


# == DQN ============================================================================================================
def dqn_build(delay_value=True):
    """TorchRL's DQN tutorial modules on CartPole-v1, tiny: an ``MLP`` Q-net with a ``QValueModule``, an
    ``EGreedyModule`` for exploration, ``DQNLoss`` with its target network (``delay_value``)."""
    env = make_env("CartPole-v1")
    value_net = TensorDictModule(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                                 out_keys=["action_value"])
    policy = TensorDictSequential(value_net, QValueModule(spec=env.action_spec))
    explore = EGreedyModule(env.action_spec, annealing_num_steps=64, eps_init=0.5)
    loss_module = DQNLoss(value_network=policy, action_space=env.action_spec, delay_value=delay_value)
    loss_module.make_value_estimator(gamma=0.99)
    return loss_module, env, TensorDictSequential(policy, explore), explore


def dqn_loop(loss_module, env, policy, explore, guard=None, updater="soft", frames=16, total=96, optim_steps=3,
             batch=8):
    """The DQN tutorial's loop: the collector's frames into a replay buffer, ``optim_steps`` updates from samples
    per batch once it holds 32 frames; after each: the exploration annealed and the target updated
    (``SoftUpdate(eps=0.9)`` or ``HardUpdate`` every 4th update)."""
    optim = torch.optim.Adam(loss_module.parameters(), lr=0.01)
    guard = guard_for(guard, loss_module, optim)
    target = SoftUpdate(loss_module, eps=0.9) if updater == "soft" else \
        HardUpdate(loss_module, value_network_update_interval=3)
    buffer = ReplayBuffer(storage=LazyTensorStorage(200))
    logs = {"loss": [], "eps": []}
    for data in collector(env, policy, frames, total, init_random_frames=16):
        buffer.extend(data)
        if len(buffer) < 32:
            continue
        for _ in range(optim_steps):
            with stepped(guard):
                loss_vals = loss_module(buffer.sample(batch))
                backward(loss_vals["loss"], guard)
                optim.step()
                optim.zero_grad()
            explore.step(data.numel())
            target.step()
            logs["loss"].append(loss_vals["loss"].item())
            logs["eps"].append(explore.eps.item())
    return {"loss_module": loss_module, "optim": optim.state_dict(), "logs": logs,
            "target": dict(loss_module.target_value_network_params.flatten_keys().items())}


@pytest.mark.parametrize("updater", ["soft", "hard"])
@pytest.mark.parametrize("check", checks())
def test_dqn_with_a_target_network_is_the_same_bare_watched_and_guarded(check, updater):
    """DQN with ``SoftUpdate`` / ``HardUpdate``: the Q-net, its target's parameters (written in place through
    ``.data`` after every update), Adam's state, the losses and the annealed epsilon bit for bit alike; quiet."""
    ref = three_runs(dqn_build, lambda *a, guard=None: dqn_loop(*a, guard=guard, updater=updater), check)
    assert len(ref["logs"]["loss"]) == 15
    online = dict(ref["loss_module"].value_network_params.flatten_keys().items())
    assert any(not torch.equal(online[k], v) for k, v in ref["target"].items())  # the target lags behind


# == SAC and DDPG ===================================================================================================
class QNet(nn.Module):
    """Q(s, a) from the observation and the action."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, observation, action):
        return self.net(torch.cat([observation, action], -1))


def actor_critic_build(kind="sac"):
    """Pendulum-v1 modules, tiny: SAC's ``TanhNormal`` actor and ``SACLoss`` (two Q-nets, their target, a learned
    alpha), or DDPG's deterministic actor and ``DDPGLoss``."""
    env = make_env("Pendulum-v1")
    qvalue = ValueOperator(QNet(), in_keys=["observation", "action"])
    if kind == "sac":
        actor = ProbabilisticActor(
            TensorDictModule(nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2), NormalParamExtractor()),
                             in_keys=["observation"], out_keys=["loc", "scale"]),
            spec=env.action_spec, in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True,
            distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high})
        loss_module = SACLoss(actor_network=actor, qvalue_network=qvalue, num_qvalue_nets=2, delay_qvalue=True)
    else:
        actor = TensorDictModule(nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1), nn.Tanh()),
                                 in_keys=["observation"], out_keys=["action"])
        loss_module = DDPGLoss(actor_network=actor, value_network=qvalue, delay_actor=True, delay_value=True)
    loss_module.make_value_estimator(gamma=0.99)
    return loss_module, env, actor


def off_policy_optimizers(loss_module, split):
    """One Adam over every parameter (``split=False``), or one per loss term: the actor's, the Q-nets', alpha's
    (SAC) as TorchRL's SAC and DDPG scripts build them."""
    if not split:
        return {"optim": torch.optim.Adam(loss_module.parameters(), lr=3e-3)}
    critic = "qvalue_network_params" if isinstance(loss_module, SACLoss) else "value_network_params"
    nets = {"actor": loss_module.actor_network_params, "qvalue": getattr(loss_module, critic)}
    optims = {name: torch.optim.Adam(list(params.flatten_keys().values()), lr=3e-3) for name, params in nets.items()}
    if hasattr(loss_module, "log_alpha"):
        optims["alpha"] = torch.optim.Adam([loss_module.log_alpha], lr=3e-3)
    return optims


TERMS = {"sac": ("loss_actor", "loss_qvalue", "loss_alpha"), "ddpg": ("loss_actor", "loss_value")}


def actor_critic_loop(loss_module, env, actor, guard=None, kind="sac", split=False, frames=16, total=64,
                      optim_steps=2, batch=8):
    """TorchRL's SAC / DDPG scripts' loop: random frames first, then the actor's; per batch ``optim_steps`` updates
    from samples: the loss terms summed and one optimizer stepped (``split=False``), or each term back-propagated
    into its own optimizer (the actor's first, as ``sota-implementations/sac`` does); the targets soft-updated."""
    optims = off_policy_optimizers(loss_module, split)
    guard = guard_for(guard, loss_module, optims)
    target = SoftUpdate(loss_module, eps=0.95)
    buffer = ReplayBuffer(storage=LazyTensorStorage(200))
    logs = {name: [] for name in TERMS[kind]}
    for data in collector(env, actor, frames, total, init_random_frames=16):
        buffer.extend(data)
        for _ in range(optim_steps):
            with stepped(guard):
                loss_vals = loss_module(buffer.sample(batch))
                if split:
                    for name, term in zip(optims, TERMS[kind]):
                        backward(loss_vals[term], guard)
                        optims[name].step()
                        optims[name].zero_grad()
                else:
                    backward(sum(loss_vals[term] for term in TERMS[kind]), guard)
                    optims["optim"].step()
                    optims["optim"].zero_grad()
            target.step()
            for term in TERMS[kind]:
                logs[term].append(loss_vals[term].detach())
    targets = {name: dict(getattr(loss_module, name).flatten_keys().items())
               for name, _ in loss_module.named_children() if name.startswith("target_")}
    return {"loss_module": loss_module, **{name: o.state_dict() for name, o in optims.items()}, "logs": logs,
            "targets": targets}


@pytest.mark.parametrize("case", ["sac-summed", "sac-split", "ddpg-summed", "ddpg-split"])
@pytest.mark.parametrize("check", checks())
def test_sac_and_ddpg_are_the_same_bare_watched_and_guarded(check, case):
    """SAC's three terms (``loss_actor``, ``loss_qvalue``, ``loss_alpha``) and DDPG's two, summed into one
    optimizer or each back-propagated into its own: every network, the target networks, alpha, each optimizer's
    state and the logged terms bit for bit alike; quiet."""
    kind, how = case.split("-")
    ref = three_runs(lambda: actor_critic_build(kind),
                     lambda *a, guard=None: actor_critic_loop(*a, guard=guard, kind=kind, split=how == "split"),
                     check)
    assert len(ref["logs"]["loss_actor"]) == 8
    if kind == "sac":
        assert ref["loss_module"].log_alpha.item() != 0.0  # alpha's optimizer stepped


# -- the mistakes ----------------------------------------------------------------------------------------------------
def ppo_run(mode, **kwargs):
    """``ppo_loop(**kwargs)`` bare (``mode=None``), with a ``GraphGuard(check="always")`` or under ``Watch``."""
    torch.manual_seed(0)
    built = ppo_build()
    if mode == "watch":
        with Watch(GraphGuard(check="always"), __file__):
            return ppo_loop(*built, **kwargs)
    return ppo_loop(*built, guard=mode, **kwargs)


def test_advantage_computed_with_grad_breaks_the_bare_loop():
    """The critic's values and TorchRL's functional GAE run with grad (``GAE`` itself runs the critic under
    ``hold_out_net``): the value target and advantage keep the critic's graph, the replay buffer stores it, and the
    second minibatch's backward goes through the graph the first freed."""
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        ppo_run(None, by_hand=True)


def test_advantage_computed_with_grad_is_stopped_naming_the_value_target():
    """With a ``GraphGuard``: stopped at step 1, before any gradient or update, naming the replay buffer's
    ``'value_target'``; under ``watch`` at step 2, before its backward, as a graph an earlier backward freed."""
    torch.manual_seed(0)
    built = ppo_build()
    start = {k: v.clone() for k, v in built[0].state_dict().items()}
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `buffer\._storage\._storage\._tensordict"
                                              r"\['value_target'\]`"):
        ppo_loop(*built, guard="always", by_hand=True)
    same(built[0].state_dict(), start)
    with pytest.raises(CarriedGraphError, match=r"step 2, .*held by `buffer\._storage\._storage\._tensordict"
                                                r"\['value_target'\]`; an earlier backward already freed"):
        ppo_run("watch", by_hand=True)


def test_advantage_computed_with_grad_is_advised_no_grad():
    """The advice for a value target stored with its graph: compute it under ``torch.no_grad()``."""
    with pytest.raises(GraphReuseError, match=r"if it is a target the loss compares with.*replay buffer.*\), compute "
                                              r"it under `torch\.no_grad\(\)`"):
        ppo_run("always", by_hand=True)


def test_advantage_computed_under_no_grad_trains():
    """The advantage computed by hand under ``torch.no_grad()``: quiet, bit for bit alike bare, watched and
    guarded."""
    three_runs(ppo_build, lambda *a, guard=None: ppo_loop(*a, guard=guard, by_hand=True, fix="no_grad"), "always")


def test_loss_vals_kept_with_their_graphs_are_warned_naming_the_key():
    """Each ``loss_vals`` TensorDict appended to a history as it is: a ``GraphLeakWarning`` naming
    ``history[0]['loss_objective']``, with a ``GraphGuard`` and under ``watch``; ``loss_vals.detach()`` (the PPO
    loop of the first test) trains quiet."""
    pattern = r"steps 1 and 2: the autograd graphs of both steps are still alive, held by `(local )?history\[0\]" \
              r"\['loss_objective'\]`.*Store loss\.item\(\) or loss\.detach\(\)"
    with pytest.warns(GraphLeakWarning, match=pattern):
        ppo_run("always", log_graphs=True)
    with pytest.warns(GraphLeakWarning, match=pattern):
        ppo_run("watch", log_graphs=True)


def test_loss_terms_back_propagated_one_by_one_are_stopped_naming_the_shared_graph():
    """``loss_vals["loss_objective"].backward()`` then ``loss_vals["loss_entropy"].backward()``: both go through the
    actor's distribution. Bare, PyTorch's error at the second; with a ``GraphGuard`` a ``DoubleBackwardError``
    before it, naming ``loss_vals['loss_objective']`` and advising ``retain_graph=True`` on the first."""
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        ppo_run(None, split=True)
    with pytest.raises(DoubleBackwardError, match=r"step 1, .*held by `(local )?loss_vals\['loss_objective'\]`.*"
                                                  r"To fix: pass retain_graph=True to the backward of 'loss'"):
        ppo_run("always", split=True)


def test_loss_terms_back_propagated_one_by_one_are_stopped_as_a_double_backward_under_watch():
    """Before any optimizer has stepped, the second term's backward from the first's line is the same step's (its
    graph shares the first's, which that backward freed): a ``DoubleBackwardError`` advising retain_graph=True, as
    with a ``GraphGuard``."""
    with pytest.raises(DoubleBackwardError, match=r"retain_graph=True"):
        ppo_run("watch", split=True)


def test_loss_terms_back_propagated_one_by_one_with_retain_graph_train():
    """The advised ``retain_graph=True`` on the objective's backward: quiet, bit for bit alike bare, watched and
    guarded."""
    three_runs(ppo_build, lambda *a, guard=None: ppo_loop(*a, guard=guard, split=True, fix="retain"), "always")


def test_a_target_network_that_is_the_online_one_is_refused_by_torchrl():
    """``DQNLoss(delay_value=False)`` (no target parameters: the target is the online network) handed to
    ``SoftUpdate``: TorchRL refuses it when the updater is made, before any update; ``delay_value=True`` (TorchRL's
    default) is the DQN loop of the tests above."""
    torch.manual_seed(0)
    loss_module = dqn_build(delay_value=False)[0]
    with pytest.raises(RuntimeError, match="Did not find any target parameters"):
        SoftUpdate(loss_module, eps=0.9)
