"""Two reinforcement-learning libraries with update code of their own, and two libraries that call the model and
autograd inside a training loop, run from the same seeds on a tiny environment written here (``Walk``: a point
walking to a goal on a line, 4 observations, 2 actions, 8 steps an episode):

- tianshou 2.0's ``DQN`` (a target network copied every 4 updates, double Q) and ``PPO`` (GAE, several minibatches
  per update, ``max_grad_norm``): its ``Collector`` fills a ``VectorReplayBuffer`` from a ``DummyVectorEnv``, and
  ``algorithm.update(buffer, ...)`` runs tianshou's own update (``Algorithm.Optimizer.step(loss)``: ``zero_grad``,
  ``loss.backward()``, clipping, ``step``), inside ``policy_within_training_step``;
- pfrl 0.4's ``DQN`` agent with its ``ReplayBuffer`` and ``ConstantEpsilonGreedy`` explorer, driven by the
  ``agent.act`` / ``agent.observe`` loop of pfrl's quickstart (``observe`` runs the update);
- torchattacks 3.3's ``PGD`` making the adversarial batch of each step (its ``torch.autograd.grad`` on the input, the
  model switched to ``eval`` and back), the training loss on that batch; and captum 0.9's ``IntegratedGradients`` of
  a fixed probe logged after each update (captum's ``autograd.grad`` between the steps). The PGD loop also as a
  ``safeloop.Trainer``.

Each runs bare, under ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script:
every backward and every ``autograd.grad`` the libraries call goes through it) and with a ``safeloop.GraphGuard``
where a user of the library puts one: tianshou hands the user no loss, so ``algorithm.update`` runs inside a
``TorchFunctionMode`` (``Backwards``) that sends each ``Tensor.backward`` to ``guard.backward``, the guard made from
the algorithm and its torch optimizer; pfrl's agent subclass runs ``guard.check(loss)`` at the end of
``_compute_loss``, whose loss pfrl then back-propagates; the PGD loop has ``with guard.step()`` around its step. Every
parameter and buffer, the optimizers' state and what the libraries record come out bit for bit the same, with no
warning the bare run does not emit.

Then the mistakes: an adversarial batch made once before the loop (torchattacks' is detached: no graph, nothing to
see; made by hand on a model's embeddings, it keeps the embedding's graph); attributions kept in a list every step
(captum's ``IntegratedGradients`` keeps no graph; ``LayerGradCam`` keeps the layer's); a TD target computed from the
online network with its graph and stored in pfrl's replay buffer; the adversarial loss summed across steps without
``.item()``. What the guard does for each is asserted, and the advised fix trains quiet.
"""
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import safeloop
from safeloop import GraphGuard
from safeloop.errors import CarriedGraphError, GraphLeakWarning, GraphReuseError
from safeloop.watch import Watch
from tests.libraries.compare import Backwards, same, stepped, three_runs
from tests.realworld.harness import checks, strict

gym = pytest.importorskip("gymnasium")
try:
    from tianshou.algorithm import DQN as TianshouDQN, PPO
    from tianshou.algorithm.modelfree.dqn import DiscreteQLearningPolicy
    from tianshou.algorithm.modelfree.reinforce import DiscreteActorPolicy
    from tianshou.algorithm.optim import AdamOptimizerFactory
    from tianshou.data import Collector, VectorReplayBuffer
    from tianshou.env import DummyVectorEnv
    from tianshou.utils.net.common import Net
    from tianshou.utils.net.discrete import DiscreteActor, DiscreteCritic
    from tianshou.utils.torch_utils import policy_within_training_step
except ImportError:
    TianshouDQN = None
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pfrl imports gym, which warns about itself
        import pfrl
except ImportError:
    pfrl = None
try:
    import torchattacks
except ImportError:
    torchattacks = None
try:
    from captum.attr import IntegratedGradients, LayerGradCam
except ImportError:
    IntegratedGradients = None

needs_tianshou = pytest.mark.skipif(TianshouDQN is None, reason="tianshou is not installed")
needs_pfrl = pytest.mark.skipif(pfrl is None, reason="pfrl is not installed")
needs_attacks = pytest.mark.skipif(torchattacks is None or IntegratedGradients is None,
                                   reason="torchattacks and captum are not installed")


# -- what every case runs ------------------------------------------------------------------------------------------
def seed_all(n) -> None:
    """torch's, NumPy's and Python's generators (pfrl's explorer and replay buffer draw from NumPy's, tianshou's
    exploration too)."""
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


class Walk(gym.Env):
    """A point walking to a goal on a line: observations (position, gap to the goal, time, 1), actions left or right
    (with a little noise from the environment's generator), reward minus the gap; ends at the goal or after 8
    steps."""

    observation_space = gym.spaces.Box(-2.0, 2.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.goal, self.t = self.np_random.uniform(-1, 1), self.np_random.uniform(-1, 1), 0
        return self.obs(), {}

    def obs(self):
        return np.array([self.pos, self.goal - self.pos, self.t / 8, 1.0], np.float32)

    def step(self, action):
        move = 0.25 if int(action) == 1 else -0.25
        self.pos = float(np.clip(self.pos + move + self.np_random.normal(0, 0.05), -1.5, 1.5))
        self.t += 1
        gap = abs(self.goal - self.pos)
        return self.obs(), -gap, bool(gap < 0.1), self.t >= 8, {}


def routed(guard):
    """``Backwards(guard)``, or nothing without a guard."""
    return Backwards(guard) if guard is not None else stepped(None)


# == tianshou =======================================================================================================
def tianshou_optimizer(algo):
    """The torch optimizer inside tianshou's ``Algorithm.Optimizer`` (which has no public accessor for it)."""
    return algo.optim._optim


def tianshou_dqn_build():
    """tianshou's DQN on ``Walk``: a ``Net`` Q-function, ε-greedy collection, a target network copied every 4
    updates; the collector and its buffer."""
    env = DummyVectorEnv([Walk])
    env.seed(0)
    policy = DiscreteQLearningPolicy(model=Net(state_shape=4, action_shape=2, hidden_sizes=[16]),
                                     action_space=env.action_space[0], eps_training=0.2)
    algo = TianshouDQN(policy=policy, optim=AdamOptimizerFactory(lr=1e-2), gamma=0.9, target_update_freq=4)
    buffer = VectorReplayBuffer(200, 1)
    return algo, Collector(algo, env, buffer, exploration_noise=True), buffer


def tianshou_ppo_build():
    """tianshou's PPO on ``Walk``: a ``DiscreteActor`` and a ``DiscreteCritic`` on their own ``Net``s, one Adam over
    both, gradients clipped to norm 0.5."""
    env = DummyVectorEnv([Walk])
    env.seed(0)
    actor = DiscreteActor(preprocess_net=Net(state_shape=4, hidden_sizes=[16]), action_shape=2)
    critic = DiscreteCritic(preprocess_net=Net(state_shape=4, hidden_sizes=[16]))
    policy = DiscreteActorPolicy(actor=actor, action_space=env.action_space[0])
    algo = PPO(policy=policy, critic=critic, optim=AdamOptimizerFactory(lr=3e-3), max_grad_norm=0.5, gamma=0.9)
    buffer = VectorReplayBuffer(64, 1)
    return algo, Collector(algo, env, buffer), buffer


def tianshou_guard(check, algo, *_):
    """Where a tianshou user makes the guard: the algorithm (every network it trains) and its torch optimizer."""
    return GraphGuard(algo, tianshou_optimizer(algo), check=check)


def tianshou_dqn_loop(algo, collector, buffer, guard=None, updates=12):
    """The off-policy trainer's loop by hand: 32 random steps first, then 4 collected steps and one update of 8
    sampled transitions, each inside ``policy_within_training_step``; the update's loss kept as tianshou returns
    it (a float)."""
    collector.reset()
    collector.collect(n_step=32, random=True)
    losses = []
    for _ in range(updates):
        with policy_within_training_step(algo.policy):
            collector.collect(n_step=4)
            with stepped(guard), routed(guard):
                stats = algo.update(buffer, 8)
        losses.append(stats.loss)
    return {"algo": algo, "optim": tianshou_optimizer(algo).state_dict(), "losses": losses,
            "target": algo.model_old.state_dict(), "rewards": torch.from_numpy(buffer.rew.copy())}


def tianshou_ppo_loop(algo, collector, buffer, guard=None, rounds=3):
    """The on-policy trainer's loop by hand: 32 collected steps, an update of 2 passes over minibatches of 16 (4
    optimizer steps), the buffer emptied; the losses tianshou records."""
    collector.reset()
    losses = []
    for _ in range(rounds):
        with policy_within_training_step(algo.policy):
            collector.collect(n_step=32)
            with routed(guard):
                stats = algo.update(buffer, batch_size=16, repeat=2)
        buffer.reset()
        losses.append((stats.loss.mean, stats.vf_loss.mean, stats.gradient_steps))
    return {"algo": algo, "optim": tianshou_optimizer(algo).state_dict(), "losses": losses}


@needs_tianshou
@pytest.mark.parametrize("check", checks())
def test_tianshou_dqn_update_is_the_same_bare_watched_and_guarded(check):
    """tianshou's DQN: the Q-network, its target, Adam's state, the losses and the collected rewards bit for bit
    alike bare, watched and with the guard around ``algorithm.update``; quiet."""
    ref = three_runs(tianshou_dqn_build, tianshou_dqn_loop, check, guard_for=tianshou_guard, seed=seed_all)
    assert len(ref["losses"]) == 12


@needs_tianshou
@pytest.mark.parametrize("check", checks())
def test_tianshou_ppo_update_is_the_same_bare_watched_and_guarded(check):
    """tianshou's PPO: several optimizer steps per ``update`` (a step of the guard ends at each), GAE and the old
    log-probabilities computed by tianshou under ``no_grad``; bit for bit alike and quiet."""
    ref = three_runs(tianshou_ppo_build, tianshou_ppo_loop, check, guard_for=tianshou_guard, seed=seed_all)
    assert [steps for _, _, steps in ref["losses"]] == [4, 4, 4]


# == pfrl ===========================================================================================================
if pfrl is not None:
    class GuardedDQN(pfrl.agents.DQN):
        """pfrl's DQN whose loss goes through ``guard.check`` before pfrl back-propagates it (``update`` calls
        ``_compute_loss``, then ``loss.backward()``)."""

        def __init__(self, *args, guard=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.guard = guard

        def _compute_loss(self, exp_batch, errors_out=None):
            loss = super()._compute_loss(exp_batch, errors_out=errors_out)
            if self.guard is not None:
                self.guard.check(loss)
            return loss


def pfrl_build():
    """pfrl's quickstart Q-function (an MLP ending in ``DiscreteActionValueHead``) and its Adam."""
    q_func = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2), pfrl.q_functions.DiscreteActionValueHead())
    return q_func, torch.optim.Adam(q_func.parameters(), lr=1e-2)


def pfrl_guard(check, q_func, optimizer):
    """A pfrl user's guard: the Q-function and its optimizer (a step ends at each of its steps)."""
    return GraphGuard(q_func, optimizer, check=check)


def pfrl_loop(q_func, optimizer, guard=None, steps=48):
    """pfrl's quickstart loop on ``Walk``: ``agent.act(obs)``, ``env.step``, ``agent.observe(...)`` (an update of 8
    replayed transitions every step once 16 are stored, the target network synchronized every 4 steps)."""
    agent = GuardedDQN(q_func, optimizer, pfrl.replay_buffers.ReplayBuffer(200), gamma=0.9, guard=guard,
                       explorer=pfrl.explorers.ConstantEpsilonGreedy(0.2, lambda: int(np.random.randint(2))),
                       replay_start_size=16, minibatch_size=8, update_interval=1, target_update_interval=4)
    env = Walk()
    obs, _ = env.reset(seed=0)
    for _ in range(steps):
        action = agent.act(obs)
        obs, reward, terminated, truncated, _ = env.step(action)
        agent.observe(obs, reward, terminated, terminated or truncated)
        if terminated or truncated:
            obs, _ = env.reset()
    return {"q_func": q_func, "optimizer": optimizer.state_dict(), "target": agent.target_model,
            "statistics": agent.get_statistics(), "updates": agent.optim_t}


@needs_pfrl
@pytest.mark.parametrize("check", checks())
def test_pfrl_dqn_act_observe_is_the_same_bare_watched_and_guarded(check):
    """pfrl's DQN agent: the Q-function, its target, Adam's state and pfrl's statistics (average Q and loss) bit for
    bit alike; quiet."""
    ref = three_runs(pfrl_build, pfrl_loop, check, guard_for=pfrl_guard, seed=seed_all)
    assert ref["updates"] == 33


# == torchattacks and captum ========================================================================================
def classifier():
    """A small classifier of 4x4 "images" in [0, 1], with a batch norm (torchattacks runs its attack in eval mode,
    so the running statistics move only in the training forward)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def images(n=6, size=8, seed=3):
    """``n`` batches of ``size`` images in [0, 1] and labels (which quarter holds the brightest mean, mod 3)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.rand(size, 1, 4, 4, generator=gen)
        out.append((x, x.reshape(size, 4, 4).mean(-1).argmax(-1) % 3))
    return out


def attack_build():
    """The classifier, the batches, and a probe batch for the attributions."""
    return classifier(), images(), images(1, 4, seed=5)[0]


def pgd(model):
    return torchattacks.PGD(model, eps=0.1, alpha=0.04, steps=3)


def pgd_loop(model, data, probe, guard=None, epochs=2, kept=None, running=None, once=False):
    """Adversarial training: each step ``adv = atk(x, y)`` (torchattacks' PGD: random start, 3 signed-gradient steps
    through the model in eval mode), the cross-entropy on ``adv``, SGD with momentum; after each update the
    model's ``IntegratedGradients`` on ``probe`` logged (in eval mode). The mistakes: ``kept``, the attributions kept
    by ``"ig"`` or ``"gradcam"`` (``LayerGradCam`` of the first linear layer), ``"*-detached"`` the advised fix;
    ``running``: ``"tensor"`` sums the losses with their graphs, ``"item"`` their ``.item()``; ``once``: the
    adversarial batch made once, before the loop, from the first batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    atk = pgd(model)
    ig = IntegratedGradients(model)
    cam = LayerGradCam(model, model[1])
    attributions, total, losses = [], 0.0, []
    if once:
        fixed_adv = atk(*data[0])
    for _ in range(epochs):
        for x, y in data:
            with stepped(guard):
                adv = fixed_adv if once else atk(x, y)
                loss = F.cross_entropy(model(adv), y)
                optimizer.zero_grad()
                guard.backward(loss) if guard is not None else loss.backward()
                optimizer.step()
            model.eval()
            if kept in ("gradcam", "gradcam-detached"):
                heat = cam.attribute(probe[0], target=probe[1])
                attributions.append(heat.detach() if kept == "gradcam-detached" else heat)
            else:
                attr = ig.attribute(probe[0], target=probe[1], n_steps=8)
                attributions.append(attr if kept == "ig" else attr.abs().sum().item())
            model.train()
            if running is not None:
                total += loss if running == "tensor" else loss.item()
            losses.append(loss.item())
    return {"model": model, "optimizer": optimizer.state_dict(), "losses": losses, "attributions": attributions,
            "total": total}


@needs_attacks
@pytest.mark.parametrize("check", checks())
def test_pgd_adversarial_training_with_integrated_gradients_is_the_same_bare_watched_and_guarded(check):
    """The PGD loop: the classifier (and its batch norm's statistics), SGD's momentum, the losses and the logged
    attributions bit for bit alike; quiet (under ``watch`` the attack's and captum's ``autograd.grad`` go through
    the guard too)."""
    ref = three_runs(attack_build, pgd_loop, check, seed=seed_all)
    assert len(ref["losses"]) == 12 and ref["losses"][-1] < ref["losses"][0]


if torchattacks is not None:
    class PGDTrainer(safeloop.Trainer):
        """The PGD loop's step as a ``training_step``: the adversarial batch from torchattacks, the loss on it."""

        def __init__(self, *, model, **kwargs):
            self.atk = pgd(model)
            super().__init__(model=model, **kwargs)

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

        def training_step(self, batch):
            x, y = batch
            return F.cross_entropy(self.model(self.atk(x, y)), y)


def pgd_plain(model, data, _probe, guard=None, epochs=2):
    """The PGD loop without the attributions (what the Trainer port runs)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    atk = pgd(model)
    for _ in range(epochs):
        for x, y in data:
            with stepped(guard):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(atk(x, y)), y)
                guard.backward(loss) if guard is not None else loss.backward()
                optimizer.step()
    return {"model": model, "optimizer": optimizer.state_dict()}


@needs_attacks
@pytest.mark.parametrize("check", checks())
def test_pgd_trainer_trains_as_the_loop(check):
    """``PGDTrainer`` for 12 steps trains the classifier bit for bit as the hand-written loop, with no warning the
    loop lacks."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = three_runs(attack_build, pgd_plain, check, seed=seed_all)
    seed_all(0)
    model, data, _ = attack_build()
    seed_all(1)
    with strict(own):
        trainer = PGDTrainer(model=model, train_data=data * 2, max_steps=12, device="cpu", progress=False,
                             loggers=(), guard={"check": check})
        trainer.fit()
    same(model, ref["model"], "model")


# -- the mistakes ----------------------------------------------------------------------------------------------------
class TextClassifier(nn.Module):
    """Token embeddings averaged, then a linear head: adversarial training perturbs the embeddings (FGM, Miyato et
    al.), not the tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, emb):
        return self.head(emb.mean(1))


def sentences(n=6, size=8, seed=7):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(20, (size, 5), generator=gen)
        out.append((tokens, tokens[:, 0] % 3))
    return out


def fgm(model, tokens, labels, eps=0.5):
    """The embeddings moved along the loss's gradient, normalized (FGM): the gradient taken with
    ``torch.autograd.grad`` (no ``.grad`` written), the embeddings kept as they are."""
    emb = model.embed(tokens)
    grad, = torch.autograd.grad(F.cross_entropy(model(emb), labels), emb)
    return emb + eps * grad / (grad.norm() + 1e-12)


def text_build():
    return TextClassifier(), sentences()


def fgm_loop(model, data, guard=None, fix=None):
    """FGM adversarial training whose adversarial batch was made once, before the loop, from the first batch (the
    mistake: ``adv`` keeps the embedding's graph); ``fix="loop"``: made in each step from its batch, the advised
    recompute; ``fix="detach"``: stored ``adv.detach()`` (a constant batch: the embedding is trained by the clean
    loss only)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    adv = fgm(model, *data[0])
    if fix == "detach":
        adv = adv.detach()
    losses = []
    for tokens, labels in data * 2:
        with stepped(guard):
            if fix == "loop":
                adv = fgm(model, tokens, labels)
            clean = F.cross_entropy(model(model.embed(tokens)), labels)
            loss = clean + F.cross_entropy(model(adv), labels if fix == "loop" else data[0][1])
            optimizer.zero_grad()
            guard.backward(loss) if guard is not None else loss.backward()
            optimizer.step()
        losses.append(loss.item())
    return {"model": model, "optimizer": optimizer.state_dict(), "losses": losses}


def td_build():
    q_func = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    return q_func, torch.optim.Adam(q_func.parameters(), lr=1e-2)


def td_loop(q_func, optimizer, guard=None, fix=None, steps=40, gamma=0.9):
    """DQN by hand on pfrl's ``ReplayBuffer``: each transition stored with its TD target, ``reward + gamma * (1 -
    terminated) * max Q(next)``, computed from the online network as it is collected (the mistake: with its graph;
    ``fix="no_grad"``: under ``torch.no_grad()``); once 16 are stored, each step an update on 8 sampled
    transitions against their stored targets."""
    buffer = pfrl.replay_buffers.ReplayBuffer(200)
    env = Walk()
    obs, _ = env.reset(seed=0)
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            action = int(q_func(torch.from_numpy(obs)).argmax()) if np.random.rand() > 0.2 else np.random.randint(2)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        with torch.no_grad() if fix == "no_grad" else stepped(None):
            target = reward + gamma * (1.0 - terminated) * q_func(torch.from_numpy(next_obs)).max()
        buffer.append(obs, action, reward, next_obs, is_state_terminal=terminated, target=target)
        obs = next_obs
        if terminated or truncated:
            buffer.stop_current_episode()
            obs, _ = env.reset()
        if len(buffer) < 16:
            continue
        batch = [t[0] for t in buffer.sample(8)]
        with stepped(guard):
            states = torch.from_numpy(np.stack([t["state"] for t in batch]))
            actions = torch.tensor([t["action"] for t in batch])
            q = q_func(states).gather(1, actions[:, None]).squeeze(1)
            loss = F.smooth_l1_loss(q, torch.stack([t["target"] for t in batch]).float())
            optimizer.zero_grad()
            guard.backward(loss) if guard is not None else loss.backward()
            optimizer.step()
        losses.append(loss.item())
    return {"q_func": q_func, "optimizer": optimizer.state_dict(), "losses": losses}


def attack_run(mode, loop, build, **kwargs):
    """``loop(*build(), **kwargs)`` with a ``GraphGuard(model, check="always")`` (``mode="guard"``) or under ``Watch``
    (``"watch"``), from the seeds of ``three_runs``."""
    seed_all(0)
    built = build()
    seed_all(1)
    if mode == "watch":
        with Watch(GraphGuard(check="always"), __file__):
            return loop(*built, **kwargs)
    return loop(*built, guard=GraphGuard(built[0], check="always"), **kwargs)


@needs_attacks
def test_a_torchattacks_batch_made_once_before_the_loop_keeps_no_graph_and_is_quiet():
    """``adv = atk(x, y)`` once, before the loop, reused every step: torchattacks returns it detached, so no graph
    is reused; a stale adversary is no graph mistake, and the guard says nothing (bit for bit alike)."""
    three_runs(attack_build, lambda *a, guard=None: pgd_loop(*a, guard=guard, once=True), "always", seed=seed_all)


@needs_attacks
def test_adversarial_embeddings_made_before_the_loop_are_stopped_at_the_first_step():
    """FGM's adversarial embeddings made once before the loop keep the embedding's graph: bare, the second step fails
    in backward; with a ``GraphGuard`` stopped at step 1, before any gradient or update, naming ``adv`` and advising
    to recompute it inside the loop."""
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        seed_all(0)
        fgm_loop(*text_build())
    seed_all(0)
    model, data = text_build()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `local adv`.*To fix: recompute `adv` inside the "
                                              r"loop.*store `adv\.detach\(\)` instead"):
        fgm_loop(model, data, guard=GraphGuard(model, check="always"))
    same(model.state_dict(), start)


@needs_attacks
def test_adversarial_embeddings_made_before_the_loop_are_stopped_at_the_first_step_under_watch():
    """Under ``watch`` FGM's ``autograd.grad`` before the loop is set-up: what the script made until then counts as
    made before training, so ``adv`` (which the loop's fix branch also assigns) is stopped at step 1."""
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `local adv`"):
        attack_run("watch", fgm_loop, text_build)


@needs_attacks
@pytest.mark.parametrize("fix", ["loop", "detach"])
def test_adversarial_embeddings_fixed_as_advised_train(fix):
    """Made in each step (``torch.autograd.grad`` on the non-leaf embeddings, then the step's loss back-propagated
    through them: watch took the embedding's node for one that ``autograd.grad`` ran and freed, a false
    ``DoubleBackwardError``, fixed), or stored detached: quiet, bit for bit alike bare, watched and guarded."""
    three_runs(text_build, lambda *a, guard=None: fgm_loop(*a, guard=guard, fix=fix), "always", seed=seed_all)


@needs_attacks
def test_integrated_gradients_kept_every_step_keep_no_graph_and_are_quiet():
    """captum's ``IntegratedGradients`` takes its gradients with ``autograd.grad`` and returns attributions without
    a graph: kept in a list every step, without ``no_grad``, they keep nothing; quiet and bit for bit alike."""
    three_runs(attack_build, lambda *a, guard=None: pgd_loop(*a, guard=guard, kept="ig"), "always", seed=seed_all)


@needs_attacks
def test_gradcam_maps_kept_every_step_are_warned_naming_the_list():
    """captum's ``LayerGradCam`` multiplies the layer's gradients by its output, made with grad: each map keeps the
    graph of the layers below. Kept in a list every step: a ``GraphLeakWarning`` naming ``attributions[0]``, with a
    ``GraphGuard`` (advising ``torch.no_grad()`` or a detach where it is added) and under ``watch``."""
    with pytest.warns(GraphLeakWarning, match=r"the tensors added to `attributions` keep their autograd graphs.*"
                                              r"`local attributions\[0\]`.*under torch\.no_grad\(\).*or detach it"):
        attack_run("guard", pgd_loop, attack_build, kept="gradcam")
    with pytest.warns(GraphLeakWarning, match=r"held by `local attributions\[0\]`.*"
                                              r"`attributions\.append\(x\.detach\(\)\)`"):
        attack_run("watch", pgd_loop, attack_build, kept="gradcam")


@needs_attacks
def test_gradcam_maps_detached_train():
    """``attributions.append(heat.detach())``: quiet, bit for bit alike bare, watched and guarded."""
    three_runs(attack_build, lambda *a, guard=None: pgd_loop(*a, guard=guard, kept="gradcam-detached"), "always",
               seed=seed_all)


@needs_attacks
def test_a_running_loss_with_its_graph_is_warned_and_item_trains():
    """``total += loss`` in the PGD loop: a ``GraphLeakWarning`` naming ``total`` and advising ``loss.item()``, with a
    ``GraphGuard``; with ``.item()`` the loop trains quiet, bit for bit."""
    with pytest.warns(GraphLeakWarning, match=r"held by `local total`.*Store loss\.item\(\) or loss\.detach\(\)"):
        attack_run("guard", pgd_loop, attack_build, running="tensor")
    three_runs(attack_build, lambda *a, guard=None: pgd_loop(*a, guard=guard, running="item"), "always",
               seed=seed_all)


@needs_attacks
def test_a_running_loss_with_its_graph_is_warned_under_watch():
    with pytest.warns(GraphLeakWarning, match=r"held by `local total`"):
        attack_run("watch", pgd_loop, attack_build, running="tensor")


@needs_pfrl
def test_a_td_target_stored_with_its_graph_is_stopped_before_the_first_update():
    """The TD target computed from the online network with grad and stored in pfrl's replay buffer: bare, a later
    update fails in backward (a sampled target's graph was freed by an earlier update); with a ``GraphGuard`` stopped at step 1,
    before any gradient or update, naming the sampled transition's ``'target'`` and advising ``torch.no_grad()``;
    under ``watch`` at step 2, before its backward, as a graph an earlier backward freed."""
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        seed_all(0)
        td_loop(*td_build())
    seed_all(0)
    q_func, optimizer = td_build()
    start = {k: v.clone() for k, v in q_func.state_dict().items()}
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `local batch\[\d+\]\['target'\]`.*compute it under "
                                              r"`torch\.no_grad\(\)`"):
        td_loop(q_func, optimizer, guard=GraphGuard(q_func, optimizer, check="always"))
    same(q_func.state_dict(), start)
    with pytest.raises(CarriedGraphError, match=r"step 2, .*held by `local batch\[\d+\]\['target'\]`; an earlier "
                                                r"backward already freed"):
        attack_run("watch", td_loop, td_build)


@needs_pfrl
def test_a_td_target_stored_with_its_graph_is_advised_no_grad_under_watch():
    with pytest.raises(CarriedGraphError, match=r"if it is a target.*`torch\.no_grad\(\)`"):
        attack_run("watch", td_loop, td_build)


@needs_pfrl
def test_a_td_target_computed_under_no_grad_trains():
    """The target under ``torch.no_grad()``: quiet, bit for bit alike bare, watched and guarded."""
    three_runs(td_build, lambda *a, guard=None: td_loop(*a, guard=guard, fix="no_grad"), "always", seed=seed_all)
