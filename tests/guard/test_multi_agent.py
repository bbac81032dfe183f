"""Multi-agent reinforcement learning under GraphGuard: QMIX as oxwhirl/pymarl trains it (src/learners/q_learner.py,
src/modules/mixers/qmix.py, src/controllers/basic_controller.py; the script is tests/watch/scripts/
pymarl_qmix_episode_batch.py) and MADDPG as shariqiqbal2810/maddpg-pytorch does (algorithms/maddpg.py ``update``,
utils/misc.py; tests/watch/scripts/maddpg_gumbel_centralized_critics.py), each with the mistakes written against
them: the mixer's parameters left out of the optimizer (ray-project/ray#5003, RLlib's port), the agents' hidden
state carried from one update to the next, the TD target not detached, double Q's argmax taken on ``mac_out``
itself; the other agents' continuous actions not detached (shariqiqbal2810/maddpg-pytorch#11: harmless, each
agent's policy gradients are cleared before its update), targets soft-updated with a graph; and MAPPO as
marlbenchmark/on-policy does (r_mappo.py ``ppo_update``, utils/valuenorm.py), with the actor and critic on one trunk.
Sizes shrunk, random episodes."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import CarriedGraphError, GraphGuard, GraphLeakWarning, InplaceModificationError, UnusedGradientWarning
from tests.guard.runs import bare, quietly, same

MODES = ["always", "auto", "off"]
N_AGENTS, N_ACTIONS, OBS, STATE, HIDDEN, EMBED = 3, 4, 5, 6, 8, 8


# QMIX (pymarl): RNN agents sharing one network, a hypernetwork mixer, a target MAC and mixer

class RNNAgent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.rnn, self.fc2 = nn.Linear(OBS + N_AGENTS, HIDDEN), nn.GRUCell(HIDDEN, HIDDEN), \
            nn.Linear(HIDDEN, N_ACTIONS)

    def init_hidden(self):
        return self.fc1.weight.new(1, HIDDEN).zero_()

    def forward(self, inputs, hidden_state):
        h = self.rnn(F.relu(self.fc1(inputs)), hidden_state.reshape(-1, HIDDEN))
        return self.fc2(h), h


class BasicMAC:
    def __init__(self):
        self.agent, self.hidden_states = RNNAgent(), None

    def forward(self, batch, t):
        bs = batch["obs"].shape[0]
        ids = torch.eye(N_AGENTS).unsqueeze(0).expand(bs, -1, -1)
        inputs = torch.cat([batch["obs"][:, t].reshape(bs * N_AGENTS, -1), ids.reshape(bs * N_AGENTS, -1)], dim=1)
        agent_outs, self.hidden_states = self.agent(inputs, self.hidden_states)
        return agent_outs.view(bs, N_AGENTS, -1)

    def init_hidden(self, batch_size):
        self.hidden_states = self.agent.init_hidden().unsqueeze(0).expand(batch_size, N_AGENTS, -1)

    def parameters(self):
        return self.agent.parameters()

    def load_state(self, other_mac):
        self.agent.load_state_dict(other_mac.agent.state_dict())


class QMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.hyper_w_1 = nn.Sequential(nn.Linear(STATE, 16), nn.ReLU(), nn.Linear(16, EMBED * N_AGENTS))
        self.hyper_w_final = nn.Sequential(nn.Linear(STATE, 16), nn.ReLU(), nn.Linear(16, EMBED))
        self.hyper_b_1 = nn.Linear(STATE, EMBED)
        self.V = nn.Sequential(nn.Linear(STATE, EMBED), nn.ReLU(), nn.Linear(EMBED, 1))

    def forward(self, agent_qs, states):
        bs = agent_qs.size(0)
        states, agent_qs = states.reshape(-1, STATE), agent_qs.view(-1, 1, N_AGENTS)
        w1 = torch.abs(self.hyper_w_1(states)).view(-1, N_AGENTS, EMBED)
        hidden = F.elu(torch.bmm(agent_qs, w1) + self.hyper_b_1(states).view(-1, 1, EMBED))
        w_final = torch.abs(self.hyper_w_final(states)).view(-1, EMBED, 1)
        return (torch.bmm(hidden, w_final) + self.V(states).view(-1, 1, 1)).view(bs, -1, 1)


def episode_batch(bs=2, steps=5):
    batch = {"obs": torch.randn(bs, steps + 1, N_AGENTS, OBS), "state": torch.randn(bs, steps + 1, STATE),
             "avail_actions": (torch.rand(bs, steps + 1, N_AGENTS, N_ACTIONS) < 0.8).long(),
             "actions": torch.randint(0, N_ACTIONS, (bs, steps + 1, N_AGENTS, 1)),
             "reward": torch.randn(bs, steps + 1, 1), "terminated": torch.zeros(bs, steps + 1, 1),
             "filled": torch.ones(bs, steps + 1, 1)}
    batch["avail_actions"][..., 0] = 1
    batch["terminated"][:, steps - 1] = 1
    return batch


def qmix(check: str | None, mistake: str | None = None) -> list[torch.Tensor]:
    """Six updates of QLearner.train (double Q, target refresh every third). ``mistake``: "mixer_left_out" (only the
    MAC's parameters in the optimizer), "hidden_carried" (no ``mac.init_hidden`` after the first update),
    "target_not_detached" (``chosen_action_qvals - targets``), "argmax_on_mac_out" (``mac_out_detach = mac_out``,
    masked in place), "argmax_on_detached_mac_out" (``mac_out.detach()`` without ``.clone()``: one storage and
    version counter)."""
    torch.manual_seed(0)
    mac, mixer = BasicMAC(), QMixer()
    params = list(mac.parameters()) + ([] if mistake == "mixer_left_out" else list(mixer.parameters()))
    target_mac, target_mixer = copy.deepcopy(mac), copy.deepcopy(mixer)
    optimiser = torch.optim.RMSprop(params=params, lr=5e-4, alpha=0.99, eps=1e-5)
    guard = GraphGuard(mixer, optimiser, check=check) if check else None
    for it in range(6):
        batch = episode_batch()
        rewards, actions = batch["reward"][:, :-1], batch["actions"][:, :-1]
        terminated, mask = batch["terminated"][:, :-1].float(), batch["filled"][:, :-1].float()
        mask[:, 1:] = mask[:, 1:] * (1 - terminated[:, :-1])
        avail_actions = batch["avail_actions"]
        mac_out = []
        if mistake != "hidden_carried" or it == 0:
            mac.init_hidden(2)
        for t in range(batch["obs"].shape[1]):
            mac_out.append(mac.forward(batch, t=t))
        mac_out = torch.stack(mac_out, dim=1)
        chosen_action_qvals = torch.gather(mac_out[:, :-1], dim=3, index=actions).squeeze(3)
        target_mac_out = []
        target_mac.init_hidden(2)
        for t in range(batch["obs"].shape[1]):
            target_mac_out.append(target_mac.forward(batch, t=t))
        target_mac_out = torch.stack(target_mac_out[1:], dim=1)
        target_mac_out[avail_actions[:, 1:] == 0] = -9999999
        mac_out_detach = {"argmax_on_mac_out": mac_out, "argmax_on_detached_mac_out": mac_out.detach()}.get(
            mistake, mac_out.clone().detach())
        mac_out_detach[avail_actions == 0] = -9999999
        cur_max_actions = mac_out_detach[:, 1:].max(dim=3, keepdim=True)[1]
        target_max_qvals = torch.gather(target_mac_out, 3, cur_max_actions).squeeze(3)
        chosen_action_qvals = mixer(chosen_action_qvals, batch["state"][:, :-1])
        target_max_qvals = target_mixer(target_max_qvals, batch["state"][:, 1:])
        targets = rewards + 0.99 * (1 - terminated) * target_max_qvals
        td_error = chosen_action_qvals - (targets if mistake == "target_not_detached" else targets.detach())
        mask = mask.expand_as(td_error)
        loss = ((td_error * mask) ** 2).sum() / mask.sum()
        optimiser.zero_grad()
        guard.backward(loss) if guard else loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 10)
        optimiser.step()
        if it % 3 == 2:
            target_mac.load_state(mac)
            target_mixer.load_state_dict(mixer.state_dict())
    return [p.detach().clone() for p in [*mac.parameters(), *mixer.parameters()]]


@pytest.mark.parametrize("check", MODES)
def test_qmix_is_quiet_and_bit_identical(check):
    assert same(quietly(qmix, check), bare(qmix))


@pytest.mark.xfail(strict=True, reason="a module whose parameters no optimizer holds is taken for one left out of "
                   "training on purpose (a teacher left trainable, a head-only fine-tune): the mixer the TD error goes "
                   "through, on the way to the agents' trained parameters, is not told apart from those")
@pytest.mark.parametrize("check", MODES)
def test_qmix_mixer_left_out_of_the_optimizer_is_warned(check):
    with pytest.warns(UnusedGradientWarning, match=r"hyper_w_1.*no optimizer updates"):
        qmix(check, "mixer_left_out")


@pytest.mark.parametrize("check", MODES)
def test_qmix_hidden_state_carried_to_the_next_update_is_stopped_at_step_2(check):
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `mac\.hidden_states`.*To fix: "
                       r"detach the carried state .*`mac\.hidden_states = mac\.hidden_states\.detach\(\)`"):
        qmix(check, "hidden_carried")


@pytest.mark.parametrize("check", MODES)
def test_qmix_target_not_detached_trains_as_the_correct_loop(check):
    """Double Q's targets come from the target MAC and mixer alone: without ``.detach()`` their backward fills the
    targets' ``.grad`` (no optimizer holds them, ``load_state_dict`` copies values only), and the update is the same."""
    assert same(quietly(qmix, check, "target_not_detached"), bare(qmix))


@pytest.mark.parametrize("mistake", ["argmax_on_mac_out", "argmax_on_detached_mac_out"])
@pytest.mark.parametrize("check", MODES)
def test_qmix_argmax_on_mac_out_itself_names_mac_out(check, mistake):
    """``mac_out_detach = mac_out`` masks ``mac_out`` in place after gather saved its slice ``mac_out[:, :-1]``: the
    written tensor is ``mac_out``, not ``target_mac_out`` (as large as the slice, masked before it was saved)."""
    with pytest.raises(InplaceModificationError, match=r"\(step 1, loss 'loss'\).*the output of AsStrided: "
                       r"`local mac_out(_detach)?` or a view of it"):
        qmix(check, mistake)


# MADDPG (shariqiqbal2810/maddpg-pytorch): per-agent centralized critics, target policies and critics soft-updated

class MLPNetwork(nn.Module):
    def __init__(self, input_dim, out_dim, tanh=False):
        super().__init__()
        self.in_fn = nn.BatchNorm1d(input_dim)
        self.fc1, self.fc2, self.fc3 = nn.Linear(input_dim, 16), nn.Linear(16, 16), nn.Linear(16, out_dim)
        self.out_fn = torch.tanh if tanh else (lambda x: x)

    def forward(self, X):
        return self.out_fn(self.fc3(F.relu(self.fc2(F.relu(self.fc1(self.in_fn(X)))))))


def onehot_from_logits(logits):
    return (logits == logits.max(1, keepdim=True)[0]).float()


def gumbel_softmax(logits, hard=True):
    y = F.softmax(logits - torch.log(-torch.log(torch.rand(logits.shape) + 1e-20) + 1e-20), dim=1)
    return (onehot_from_logits(y) - y).detach() + y if hard else y


def soft_update(target, source, tau, mistake=None):
    if mistake == "soft_update_with_graph":  # the polyak update of a frozen target without torch.no_grad() nor .data
        for target_param, param in zip(target.parameters(), source.parameters()):
            target_param.mul_(1.0 - tau).add_(param * tau)
        return
    for target_param, param in zip(target.parameters(), source.parameters()):
        target_param.data.copy_(target_param.data * (1.0 - tau) + param.data * tau)


def maddpg(check: str | None, mistake: str | None = None, discrete: bool = True) -> list[torch.Tensor]:
    """Four rounds of MADDPG.update for each of three agents, then update_all_targets. ``discrete=False``: tanh
    policies, the other agents' actions ``pi(ob)`` with their graph (``mistake="others_detached"``: ``.detach()``ed);
    ``mistake``: "target_not_detached" (``MSELoss(actual_value, target_value)``), "soft_update_with_graph" (targets
    frozen with ``requires_grad_(False)``, written in place outside ``torch.no_grad()``)."""
    torch.manual_seed(0)
    nagents, obs_dim, n_act = 3, 4, 5
    critic_in = nagents * (obs_dim + n_act)
    nets = nn.ModuleList(nn.ModuleDict({"policy": MLPNetwork(obs_dim, n_act, not discrete),
                                        "critic": MLPNetwork(critic_in, 1)}) for _ in range(nagents))
    targets = copy.deepcopy(nets)
    if mistake == "soft_update_with_graph":
        targets.requires_grad_(False)
    policy_opts = [torch.optim.Adam(n["policy"].parameters(), lr=0.01) for n in nets]
    critic_opts = [torch.optim.Adam(n["critic"].parameters(), lr=0.01) for n in nets]
    guard = GraphGuard(nets, [*policy_opts, *critic_opts], check=check) if check else None
    backward = guard.backward if guard else torch.Tensor.backward
    act = onehot_from_logits if discrete else (lambda x: x)
    for _ in range(4):
        obs, next_obs = [torch.randn(6, obs_dim) for _ in range(nagents)], [torch.randn(6, obs_dim) for _ in range(3)]
        acs = [F.one_hot(torch.randint(0, n_act, (6,)), n_act).float() for _ in range(nagents)]
        rews, dones = [torch.randn(6) for _ in range(nagents)], [torch.zeros(6) for _ in range(nagents)]
        for agent_i in range(nagents):
            critic_opts[agent_i].zero_grad()
            all_trgt_acs = [act(t["policy"](nobs)) for t, nobs in zip(targets, next_obs)]
            target_value = rews[agent_i].view(-1, 1) + 0.95 * targets[agent_i]["critic"](
                torch.cat((*next_obs, *all_trgt_acs), dim=1)) * (1 - dones[agent_i].view(-1, 1))
            actual_value = nets[agent_i]["critic"](torch.cat((*obs, *acs), dim=1))
            vf_loss = F.mse_loss(actual_value, target_value if mistake == "target_not_detached"
                                 else target_value.detach())
            backward(vf_loss)
            torch.nn.utils.clip_grad_norm_(nets[agent_i]["critic"].parameters(), 0.5)
            critic_opts[agent_i].step()
            policy_opts[agent_i].zero_grad()
            curr_pol_out = nets[agent_i]["policy"](obs[agent_i])
            curr_pol_vf_in = gumbel_softmax(curr_pol_out) if discrete else curr_pol_out
            all_pol_acs = []
            for i, n, ob in zip(range(nagents), nets, obs):
                if i == agent_i:
                    all_pol_acs.append(curr_pol_vf_in)
                else:
                    other = act(n["policy"](ob))
                    all_pol_acs.append(other.detach() if mistake == "others_detached" else other)
            pol_loss = -nets[agent_i]["critic"](torch.cat((*obs, *all_pol_acs), dim=1)).mean()
            pol_loss += (curr_pol_out ** 2).mean() * 1e-3
            backward(pol_loss)
            torch.nn.utils.clip_grad_norm_(nets[agent_i]["policy"].parameters(), 0.5)
            policy_opts[agent_i].step()
        for t, n in zip(targets, nets):
            soft_update(t["critic"], n["critic"], 0.01, mistake)
            soft_update(t["policy"], n["policy"], 0.01, mistake)
    return [p.detach().clone() for p in [*nets.parameters(), *targets.parameters()]]


@pytest.mark.parametrize("check", MODES)
def test_maddpg_discrete_is_quiet_and_bit_identical(check):
    assert same(quietly(maddpg, check), bare(maddpg))


@pytest.mark.parametrize("check", MODES)
def test_maddpg_continuous_other_agents_actions_with_their_graph_are_quiet(check):
    """shariqiqbal2810/maddpg-pytorch#11: ``pi(ob)`` of the other agents is not detached; their policies' gradients are
    cleared before their own update, so it trains as with ``.detach()``."""
    assert same(quietly(maddpg, check, None, False), bare(maddpg, "others_detached", False))


@pytest.mark.parametrize("check", MODES)
def test_maddpg_target_value_not_detached_trains_as_the_correct_loop(check):
    """The critic's target through the target policies and critic, not detached: their ``.grad`` fill (no optimizer
    holds them; soft_update writes ``.data``), the update is the same."""
    assert same(quietly(maddpg, check, "target_not_detached"), bare(maddpg))


@pytest.mark.parametrize("discrete", [True, False])
@pytest.mark.parametrize("check", ["always", "auto"])
def test_maddpg_frozen_targets_soft_updated_outside_no_grad_are_a_leak(check, discrete):
    with pytest.warns(GraphLeakWarning, match=r"the parameters `targets\.0\.policy\.in_fn\.weight`.*hold an autograd "
                      r"graph: written in place outside torch\.no_grad\(\).*To fix: make that write under "
                      r"`torch\.no_grad\(\)`"):
        got = maddpg(check, "soft_update_with_graph", discrete)
    assert same(got, bare(maddpg, "soft_update_with_graph", discrete))


# MAPPO (marlbenchmark/on-policy, onpolicy/algorithms/r_mappo/r_mappo.py ppo_update and cal_value_loss,
# onpolicy/utils/valuenorm.py): one actor shared by the agents (their observations stacked into the batch), a critic
# on the shared observation, values from the same evaluate_actions call as the log-probs, the actor's step before the
# critic's loss, a clipped value loss against returns normalized by ValueNorm (updated under torch.no_grad())

class ValueNorm(nn.Module):
    def __init__(self, input_shape, beta=0.99999, epsilon=1e-5):
        super().__init__()
        self.epsilon, self.beta = epsilon, beta
        self.running_mean = nn.Parameter(torch.zeros(input_shape), requires_grad=False)
        self.running_mean_sq = nn.Parameter(torch.zeros(input_shape), requires_grad=False)
        self.debiasing_term = nn.Parameter(torch.tensor(0.0), requires_grad=False)

    def running_mean_var(self):
        debiased_mean = self.running_mean / self.debiasing_term.clamp(min=self.epsilon)
        debiased_mean_sq = self.running_mean_sq / self.debiasing_term.clamp(min=self.epsilon)
        return debiased_mean, (debiased_mean_sq - debiased_mean ** 2).clamp(min=1e-2)

    @torch.no_grad()
    def update(self, input_vector):
        batch_mean, batch_sq_mean = input_vector.mean(dim=0), (input_vector ** 2).mean(dim=0)
        self.running_mean.mul_(self.beta).add_(batch_mean * (1.0 - self.beta))
        self.running_mean_sq.mul_(self.beta).add_(batch_sq_mean * (1.0 - self.beta))
        self.debiasing_term.mul_(self.beta).add_(1.0 * (1.0 - self.beta))

    def normalize(self, input_vector):
        mean, var = self.running_mean_var()
        return (input_vector - mean[None]) / torch.sqrt(var)[None]


def mappo(check: str | None, shared_trunk: bool = False) -> list[torch.Tensor]:
    """Three rollouts of 4 steps of 3 agents, 2 PPO epochs of 2 minibatches. ``shared_trunk``: the actor and critic
    read one trunk (each optimizer holds it), whose weights the actor's step writes before the backward of the value
    loss, whose graph saved them (``values`` from the same evaluate_actions call as the log-probs)."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(OBS, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    actor = nn.Sequential(trunk if shared_trunk else nn.Sequential(nn.Linear(OBS, 16), nn.Tanh()),
                          nn.Linear(16, N_ACTIONS))
    critic = nn.Sequential(trunk, nn.Linear(16, 1)) if shared_trunk else \
        nn.Sequential(nn.Linear(STATE, 16), nn.Tanh(), nn.Linear(16, 1))
    critic_params = list(critic.parameters())
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=5e-4, eps=1e-5)
    critic_optimizer = torch.optim.Adam(critic_params, lr=5e-4, eps=1e-5)
    value_normalizer = ValueNorm(1)
    guard = GraphGuard(actor, [actor_optimizer, critic_optimizer], check=check) if check else None
    backward = guard.backward if guard else torch.Tensor.backward
    for _ in range(3):
        n = 4 * N_AGENTS
        obs, share_obs = torch.randn(n, OBS), torch.randn(n, STATE)
        with torch.no_grad():
            dist = torch.distributions.Categorical(logits=actor(obs))
            actions = dist.sample()
            old_log_probs = dist.log_prob(actions).unsqueeze(-1)
            value_preds = critic(obs if shared_trunk else share_obs)
        returns = value_preds + torch.randn(n, 1)
        advantages = returns - value_preds
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-5)
        for _ in range(2):
            for idx in torch.randperm(n).chunk(2):
                dist = torch.distributions.Categorical(logits=actor(obs[idx]))
                values = critic(obs[idx] if shared_trunk else share_obs[idx])
                action_log_probs, dist_entropy = dist.log_prob(actions[idx]).unsqueeze(-1), dist.entropy().mean()
                imp_weights = torch.exp(action_log_probs - old_log_probs[idx])
                surr1 = imp_weights * advantages[idx]
                surr2 = torch.clamp(imp_weights, 1.0 - 0.2, 1.0 + 0.2) * advantages[idx]
                policy_loss = -torch.sum(torch.min(surr1, surr2), dim=-1, keepdim=True).mean()
                actor_optimizer.zero_grad()
                backward(policy_loss - dist_entropy * 0.01)
                nn.utils.clip_grad_norm_(actor.parameters(), 10.0)
                actor_optimizer.step()
                value_pred_clipped = value_preds[idx] + (values - value_preds[idx]).clamp(-0.2, 0.2)
                value_normalizer.update(returns[idx])
                error_clipped = value_normalizer.normalize(returns[idx]) - value_pred_clipped
                error_original = value_normalizer.normalize(returns[idx]) - values
                value_loss = torch.max(error_original ** 2 / 2, error_clipped ** 2 / 2).mean()
                critic_optimizer.zero_grad()
                backward(value_loss * 1.0)
                nn.utils.clip_grad_norm_(critic_params, 10.0)
                critic_optimizer.step()
    return [p.detach().clone() for p in [*actor.parameters(), *critic.parameters(), *value_normalizer.parameters()]]


@pytest.mark.parametrize("check", MODES)
def test_mappo_is_quiet_and_bit_identical(check):
    assert same(quietly(mappo, check), bare(mappo))


@pytest.mark.parametrize("check", MODES)
def test_mappo_values_through_a_trunk_the_actor_step_wrote_name_the_actor_optimizer(check):
    with pytest.raises(InplaceModificationError, match=r"\(step 2, loss 'loss'\): optimizer 'actor_optimizer' stepped "
                       r"after this loss was built and before its backward.*To fix: recompute the loss after the "
                       r"optimizer step"):
        mappo(check, shared_trunk=True)


@pytest.mark.xfail(strict=True, reason="the value loss is built after the actor's step, from `values` computed "
                   "before it; the tensors made from `values` (value_pred_clipped, error_original, error_clipped) "
                   "all reach the node that saved the trunk's weight, so no sole holder is found and the fix says "
                   "'recompute the loss', not `values`")
def test_mappo_values_through_a_trunk_the_actor_step_wrote_name_values():
    with pytest.raises(InplaceModificationError, match=r"To fix: recompute `values` after the optimizer step"):
        mappo("always", shared_trunk=True)
