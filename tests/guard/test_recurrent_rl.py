"""Recurrent and model-based reinforcement learning: CleanRL's recurrent PPO (vwxyzjn/cleanrl, cleanrl/
ppo_atari_lstm.py: the LSTM state carried through the rollout under ``torch.no_grad()``, masked by ``done``, and
``initial_lstm_state`` given again to every minibatch), a recurrent TD3 whose replay buffer stores the actor's LSTM
state of each transition (AntoineTheb/RNN-RL, algos/TD3.py, utils/memory.py and main.py: the state stored with
``h.detach().cpu()``, "so that BPTT only goes through 1 timestep"), MuZero's unrolled model (werner-duvaud/
muzero-general, trainer.py ``update_weights`` and models.py: the hidden state scaled to [0, 1] with an in-place
``+= 1e-5``, gradients scaled by hooks, losses summed over the unrolled steps), and World Models' MDN-RNN trained on
the latents of a VAE (ctallec/world-models, trainmdrnn.py). Sizes shrunk, random environments."""
import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions.categorical import Categorical

from safeloop import CarriedGraphError, GraphGuard, GraphLeakWarning
from tests.guard.runs import quietly
# muzero-general's helpers, as tests/realworld/test_muzero.py ports them
from tests.realworld.test_muzero import loss_function, normalized, scalar_to_support, scale_gradient

MODES = ["always", "auto", "off"]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# CleanRL's recurrent PPO: tests/watch/scripts/cleanrl_ppo_lstm.py is the script; here its update under GraphGuard

class LSTMAgent(nn.Module):
    def __init__(self):
        super().__init__()
        self.network, self.lstm = nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.LSTM(8, 6)
        self.actor, self.critic = nn.Linear(6, 2), nn.Linear(6, 1)

    def get_states(self, x, lstm_state, done):
        hidden = self.network(x)
        batch_size = lstm_state[0].shape[1]
        hidden, done = hidden.reshape((-1, batch_size, self.lstm.input_size)), done.reshape((-1, batch_size))
        new_hidden = []
        for h, d in zip(hidden, done):
            h, lstm_state = self.lstm(h.unsqueeze(0), ((1.0 - d).view(1, -1, 1) * lstm_state[0],
                                                       (1.0 - d).view(1, -1, 1) * lstm_state[1]))
            new_hidden += [h]
        return torch.flatten(torch.cat(new_hidden), 0, 1), lstm_state

    def get_action_and_value(self, x, lstm_state, done, action=None):
        hidden, lstm_state = self.get_states(x, lstm_state, done)
        probs = Categorical(logits=self.actor(hidden))
        action = probs.sample() if action is None else action
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden), lstm_state


def ppo_lstm(check: str | None) -> list[torch.Tensor]:
    """Three iterations of a five-step rollout of four environments, two epochs of two minibatches of environments."""
    torch.manual_seed(0)
    np.random.seed(0)
    agent = LSTMAgent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    guard = GraphGuard(agent, optimizer, check=check) if check else None
    num_steps, num_envs = 5, 4
    obs, actions, logprobs = torch.zeros((num_steps, num_envs, 4)), torch.zeros((5, 4)), torch.zeros((5, 4))
    dones, values = torch.zeros((num_steps, num_envs)), torch.zeros((num_steps, num_envs))
    next_obs, next_done = torch.randn(num_envs, 4), torch.zeros(num_envs)
    next_lstm_state = (torch.zeros(1, num_envs, 6), torch.zeros(1, num_envs, 6))
    for _ in range(3):
        initial_lstm_state = (next_lstm_state[0].clone(), next_lstm_state[1].clone())
        for step in range(num_steps):
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value, next_lstm_state = agent.get_action_and_value(next_obs, next_lstm_state,
                                                                                        next_done)
                values[step] = value.flatten()
            actions[step], logprobs[step] = action, logprob
            next_obs, next_done = torch.randn(num_envs, 4), (torch.rand(num_envs) < 0.2).float()
        returns = values + torch.randn(num_steps, num_envs)
        b_obs, b_logprobs, b_actions = obs.reshape((-1, 4)), logprobs.reshape(-1), actions.reshape(-1)
        b_dones, b_advantages, b_returns = dones.reshape(-1), (returns - values).reshape(-1), returns.reshape(-1)
        envinds, flatinds = np.arange(num_envs), np.arange(num_steps * num_envs).reshape(num_steps, num_envs)
        for _ in range(2):
            np.random.shuffle(envinds)
            for start in range(0, num_envs, 2):
                mbenvinds = envinds[start:start + 2]
                mb_inds = flatinds[:, mbenvinds].ravel()
                _, newlogprob, entropy, newvalue, _ = agent.get_action_and_value(
                    b_obs[mb_inds], (initial_lstm_state[0][:, mbenvinds], initial_lstm_state[1][:, mbenvinds]),
                    b_dones[mb_inds], b_actions.long()[mb_inds])
                ratio = (newlogprob - b_logprobs[mb_inds]).exp()
                mb_advantages = b_advantages[mb_inds]
                pg_loss = torch.max(-mb_advantages * ratio, -mb_advantages * torch.clamp(ratio, 0.9, 1.1)).mean()
                loss = pg_loss - 0.01 * entropy.mean() + 0.25 * ((newvalue.view(-1) - b_returns[mb_inds]) ** 2).mean()
                optimizer.zero_grad()
                guard.backward(loss) if guard else loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                optimizer.step()
    return [p.detach().clone() for p in agent.parameters()]


@pytest.mark.parametrize("check", MODES)
def test_recurrent_ppo_with_its_rollout_state_under_no_grad_is_quiet_and_bit_identical(check):
    assert same(quietly(ppo_lstm, check), ppo_lstm(None))


# A recurrent TD3 storing the actor's LSTM state in its replay buffer (AntoineTheb/RNN-RL)

class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.LSTM(3, 6, batch_first=True), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, state, hidden):
        a, h = self.l1(state, hidden)
        return torch.tanh(self.l3(F.relu(self.l2(a)))), h


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l4 = nn.LSTM(5, 6, batch_first=True), nn.LSTM(5, 6, batch_first=True)
        self.l2, self.l3, self.l5, self.l6 = nn.Linear(6, 6), nn.Linear(6, 1), nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, state, action, hidden1, hidden2):
        sa = torch.cat([state, action], -1)
        q1, hidden1 = self.l1(sa, hidden1)
        q2, hidden2 = self.l4(sa, hidden2)
        return self.l3(F.relu(self.l2(q1))), self.l6(F.relu(self.l5(q2)))

    def Q1(self, state, action, hidden1):
        q1, hidden1 = self.l1(torch.cat([state, action], -1), hidden1)
        return self.l3(F.relu(self.l2(q1)))


def recurrent_td3(check: str | None, act_no_grad: bool = True, stored: str = "numpy") -> list[torch.Tensor]:
    """Ten environment steps, five to an episode, an update from the third on (the actor's every second).
    ``act_no_grad``: the action selected under ``torch.no_grad()`` (RNN-RL's ``select_action`` is not);
    ``stored``: the LSTM states stored in numpy arrays as ``h.detach().cpu()`` (RNN-RL's buffer), or in tensors as they
    are (``"graph"``) or detached (``"detached"``), the sampled ones given to the critic and the actor as their initial
    state."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    actor, critic = Actor(), Critic()
    actor_target, critic_target = copy.deepcopy(actor), copy.deepcopy(critic)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=3e-4)
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=3e-4)
    guard = GraphGuard(optimizers=[critic_optimizer, actor_optimizer], check=check) if check else None
    backward = guard.backward if guard else torch.Tensor.backward
    S, A, NS, R, D = (np.zeros((16, n)) for n in (3, 2, 3, 1, 1))
    H, C, NH, NC = (np.zeros((16, 6)) for _ in range(4)) if stored == "numpy" else (torch.zeros(16, 6) for _ in range(4))
    ptr, hidden, state = 0, (torch.zeros(1, 1, 6), torch.zeros(1, 1, 6)), rng.standard_normal(3)
    for t in range(1, 11):
        x = torch.FloatTensor(state.reshape(1, -1))[:, None, :]
        if act_no_grad:
            with torch.no_grad():
                a, next_hidden = actor(x, hidden)
        else:
            a, next_hidden = actor(x, hidden)
        action = a.cpu().data.numpy().flatten()
        next_state, reward, done = rng.standard_normal(3), rng.standard_normal(), t % 5 == 0
        S[ptr], A[ptr], NS[ptr], R[ptr], D[ptr] = state, action, next_state, reward, 1. - done
        h, c = hidden
        nh, nc = next_hidden
        if stored == "numpy":
            H[ptr], C[ptr], NH[ptr], NC[ptr] = h.detach().cpu(), c.detach().cpu(), nh.detach().cpu(), nc.detach().cpu()
        elif stored == "detached":  # the first fix of "graph", applied as written
            H[ptr], C[ptr], NH[ptr], NC[ptr] = h[0, 0].detach(), c[0, 0].detach(), nh[0, 0].detach(), nc[0, 0].detach()
        else:
            H[ptr], C[ptr], NH[ptr], NC[ptr] = h[0, 0], c[0, 0], nh[0, 0], nc[0, 0]
        ptr += 1
        state, hidden = next_state, next_hidden
        if t >= 3:
            ind = rng.integers(0, ptr, size=4)
            if stored == "numpy":
                hb = tuple(torch.tensor(m[ind][None, ...], requires_grad=True, dtype=torch.float) for m in (H, C))
                nhb = tuple(torch.tensor(m[ind][None, ...], requires_grad=True, dtype=torch.float) for m in (NH, NC))
            else:
                hb, nhb = (H[ind][None], C[ind][None]), (NH[ind][None], NC[ind][None])
            s, a_, ns, r, d = (torch.FloatTensor(m[ind][:, None, :]) for m in (S, A, NS, R, D))
            with torch.no_grad():
                noise = (torch.randn_like(a_) * 0.2).clamp(-0.5, 0.5)
                next_action = (actor_target(ns, nhb)[0] + noise).clamp(-1, 1)
                target_Q1, target_Q2 = critic_target(ns, next_action, nhb, nhb)
                target_Q = r + d * 0.99 * torch.min(target_Q1, target_Q2)
            current_Q1, current_Q2 = critic(s, a_, hb, hb)
            critic_loss = F.mse_loss(current_Q1, target_Q) + F.mse_loss(current_Q2, target_Q)
            critic_optimizer.zero_grad()
            backward(critic_loss)
            critic_optimizer.step()
            if t % 2 == 0:
                actor_loss = -critic.Q1(s, actor(s, hb)[0], hb).mean()
                actor_optimizer.zero_grad()
                backward(actor_loss)
                actor_optimizer.step()
                for param, target_param in zip(critic.parameters(), critic_target.parameters()):
                    target_param.data.copy_(0.005 * param.data + 0.995 * target_param.data)
                for param, target_param in zip(actor.parameters(), actor_target.parameters()):
                    target_param.data.copy_(0.005 * param.data + 0.995 * target_param.data)
        if done:
            state, hidden = rng.standard_normal(3), (torch.zeros(1, 1, 6), torch.zeros(1, 1, 6))
    return [p.detach().clone() for p in [*actor.parameters(), *critic.parameters()]]


@pytest.mark.parametrize("check", MODES)
def test_recurrent_td3_acting_under_no_grad_is_quiet_and_bit_identical(check):
    """The LSTM states stored detached, read back as leaves that require grad (RNN-RL's ``torch.tensor(...,
    requires_grad=True)``): their gradients go to no optimizer's parameters, and nothing is said."""
    assert same(quietly(recurrent_td3, check), recurrent_td3(None))


@pytest.mark.parametrize("check", ["always", "auto"])
def test_recurrent_td3_acting_with_grad_as_written_is_warned_and_trains_the_same(check):
    """RNN-RL's ``select_action`` runs the actor outside ``torch.no_grad()``: the carried state ``hidden`` keeps the
    graph of the whole episode so far, one LSTM step more at every environment step (PyTorch trains on; the memory
    grows until the episode ends). A leak, warned once, the training unchanged."""
    with pytest.warns(GraphLeakWarning, match=r"hold an autograd graph: made again from their last value") as caught:
        ours = recurrent_td3(check, act_no_grad=False)
    assert len(caught) == 1
    assert same(ours, recurrent_td3(None, act_no_grad=False))


def test_recurrent_td3_acting_with_grad_names_the_carried_state():
    """Named by `hidden`, the state the actor makes again, not by `h` and `c` of `h, c = hidden` (its value one
    environment step ago), nor by `nh` of `nh, nc = next_hidden` (another name of it)."""
    with pytest.warns(GraphLeakWarning) as caught:
        recurrent_td3("always", act_no_grad=False)
    assert re.search(r"the tensors `local hidden\[0\]`, `local hidden\[1\]` hold", str(caught[0].message))


@pytest.mark.parametrize("check", ["always", "auto"])
def test_recurrent_td3_states_stored_with_their_graph_are_stopped_before_the_backward(check):
    """Acting with grad and storing the states without RNN-RL's ``.detach()``, into tensors: the critic's backward
    frees the acting graph of a sampled state, and a later update samples it again (bare: PyTorch's 'Trying to
    backward through the graph a second time')."""
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\)"):
        recurrent_td3(check, act_no_grad=False, stored="graph")


@pytest.mark.parametrize("check", ["always", "auto"])
def test_recurrent_td3_states_stored_with_their_graph_are_told_to_be_stored_detached(check):
    """Named by the buffer the loss reaches the acting graph through (`C`), not by `c`, the variable still holding that
    state; the first fix detaches what is written into it and into the buffers written so beside it. Applied as
    written, the update trains as RNN-RL's own (acting with grad, the states stored detached), whose acting graph is
    then only warned as a leak."""
    with pytest.raises(CarriedGraphError) as caught:
        recurrent_td3(check, act_no_grad=False, stored="graph")
    assert re.search(r"held by `local C`", str(caught.value)), str(caught.value)
    assert caught.value.fixes[0].startswith("detach what is written into `C` where it is written (`C[i] = "
                                            "x.detach()`"), caught.value.fixes[0]
    assert "(and alike for `H`, `NH`, `NC`, written so beside it)" in caught.value.fixes[0]
    with pytest.warns(GraphLeakWarning, match=r"`local hidden\[0\]`"):
        ours = recurrent_td3(check, act_no_grad=False, stored="detached")
    assert same(ours, recurrent_td3(None, act_no_grad=False, stored="detached"))


def test_recurrent_td3_states_stored_with_their_graph_under_no_grad_acting_are_quiet():
    """Acting under ``torch.no_grad()``, the states stored in tensors as they are hold no graph."""
    assert same(quietly(recurrent_td3, "always", stored="graph"), recurrent_td3(None, stored="graph"))


# MuZero's unrolled model (werner-duvaud/muzero-general)

def support_to_scalar(logits, support_size):
    probabilities = torch.softmax(logits, dim=1)
    support = torch.tensor([x for x in range(-support_size, support_size + 1)]).expand(probabilities.shape).float()
    x = torch.sum(support * probabilities, dim=1, keepdim=True)
    return torch.sign(x) * (((torch.sqrt(1 + 4 * 0.001 * (torch.abs(x) + 1 + 0.001)) - 1) / (2 * 0.001)) ** 2 - 1)


class MuZeroNetwork(nn.Module):
    def __init__(self, support_size=3, actions=2, encoding=5):
        super().__init__()
        self.action_space_size, self.full_support_size = actions, 2 * support_size + 1
        self.representation_network = nn.Linear(4, encoding)
        self.dynamics_encoded_state_network = nn.Linear(encoding + actions, encoding)
        self.dynamics_reward_network = nn.Linear(encoding, self.full_support_size)
        self.prediction_policy_network = nn.Linear(encoding, actions)
        self.prediction_value_network = nn.Linear(encoding, self.full_support_size)

    def prediction(self, encoded_state):
        return self.prediction_policy_network(encoded_state), self.prediction_value_network(encoded_state)

    def dynamics(self, encoded_state, action):
        action_one_hot = torch.zeros((action.shape[0], self.action_space_size)).float()
        action_one_hot.scatter_(1, action.long(), 1.0)
        next_encoded_state = self.dynamics_encoded_state_network(torch.cat((encoded_state, action_one_hot), dim=1))
        return normalized(next_encoded_state), self.dynamics_reward_network(next_encoded_state)

    def initial_inference(self, observation):
        encoded_state = normalized(self.representation_network(observation))
        policy_logits, value = self.prediction(encoded_state)
        reward = torch.log(torch.zeros(1, self.full_support_size).scatter(
            1, torch.tensor([[self.full_support_size // 2]]).long(), 1.0).repeat(len(observation), 1))
        return value, reward, policy_logits, encoded_state

    def recurrent_inference(self, encoded_state, action):
        next_encoded_state, reward = self.dynamics(encoded_state, action)
        policy_logits, value = self.prediction(next_encoded_state)
        return value, reward, policy_logits, next_encoded_state


def muzero_batch(rng, unroll: int = 3, support_size: int = 3):
    """A batch as the replay buffer gives it: observations, actions, value/reward/policy targets from numpy."""
    observation_batch = torch.tensor(rng.standard_normal((6, 4))).float()
    action_batch = torch.tensor(rng.integers(0, 2, (6, unroll + 1))).long().unsqueeze(-1)
    target_value = scalar_to_support(torch.tensor(rng.standard_normal((6, unroll + 1))).float(), support_size)
    target_reward = scalar_to_support(torch.tensor(rng.standard_normal((6, unroll + 1))).float(), support_size)
    target_policy = torch.softmax(torch.tensor(rng.standard_normal((6, unroll + 1, 2))).float(), -1)
    return observation_batch, action_batch, target_value, target_reward, target_policy


def unrolled_losses(model, batch, scaling: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``update_weights``' predictions and the losses of each unrolled step, their gradients scaled by hooks
    (``scaling="hooks"``, as trainer.py does, the lambdas reading the loop's ``i`` late as there) or by the paper's
    ``scale_gradient``; the reward loss of the first step left out (``0``)."""
    observation_batch, action_batch, target_value, target_reward, target_policy = batch
    gradient_scale_batch = torch.full(action_batch.shape[:2], float(action_batch.shape[1] - 1))
    value, reward, policy_logits, hidden_state = model.initial_inference(observation_batch)
    predictions = [(value, reward, policy_logits)]
    for i in range(1, action_batch.shape[1]):
        value, reward, policy_logits, hidden_state = model.recurrent_inference(hidden_state, action_batch[:, i])
        if scaling == "hooks":
            hidden_state.register_hook(lambda grad: grad * 0.5)
        else:
            hidden_state = scale_gradient(hidden_state, 0.5)
        predictions.append((value, reward, policy_logits))
    losses = []
    for i, (value, reward, policy_logits) in enumerate(predictions):
        current = list(loss_function(value.squeeze(-1), reward.squeeze(-1), policy_logits, target_value[:, i],
                                     target_reward[:, i], target_policy[:, i]))
        pred_value_scalar = support_to_scalar(value, 3).detach().cpu().numpy().squeeze()  # the priorities'
        assert pred_value_scalar.shape == (6,)
        for k in range(3):
            if i and scaling == "hooks":
                current[k].register_hook(lambda grad: grad / gradient_scale_batch[:, i])
            elif i:
                current[k] = scale_gradient(current[k], 1 / gradient_scale_batch[:, i])
        losses.append((current[0], current[1] if i else 0, current[2]))
    return losses


def muzero(check: str | None, scaling: str = "hooks") -> list[torch.Tensor]:
    """Four training steps, the three sums started again in each (``update_weights``' locals)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = MuZeroNetwork()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    guard = GraphGuard(model, optimizer, check=check) if check else None
    for _ in range(4):
        value_loss, reward_loss, policy_loss = (0, 0, 0)
        for current_value_loss, current_reward_loss, current_policy_loss in unrolled_losses(
                model, muzero_batch(rng), scaling):
            value_loss += current_value_loss
            reward_loss += current_reward_loss
            policy_loss += current_policy_loss
        loss = (value_loss * 0.25 + reward_loss + policy_loss).mean()
        optimizer.zero_grad()
        guard.backward(loss) if guard else loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def muzero_sums_kept(check: str, started_again: bool = False) -> list[torch.Tensor]:
    """``muzero`` with the sums started once, before the loop: each step adds to the last one's; ``started_again``:
    the first fix applied as written."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = MuZeroNetwork()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    guard = GraphGuard(model, optimizer, check=check)
    value_loss, reward_loss, policy_loss = (0, 0, 0)
    for _ in range(4):
        for current_value_loss, current_reward_loss, current_policy_loss in unrolled_losses(
                model, muzero_batch(rng), "hooks"):
            value_loss += current_value_loss
            reward_loss += current_reward_loss
            policy_loss += current_policy_loss
        loss = (value_loss * 0.25 + reward_loss + policy_loss).mean()
        optimizer.zero_grad()
        guard.backward(loss)
        optimizer.step()
        if started_again:
            policy_loss = 0; value_loss = 0; reward_loss = 0  # noqa: E702
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("scaling", ["hooks", "paper"])
@pytest.mark.parametrize("check", MODES)
def test_muzero_unrolled_with_scaled_gradients_and_states_written_in_place_is_quiet_and_bit_identical(check, scaling):
    """Hooks on the hidden states and losses (the last state's never runs), the in-place ``+= 1e-5`` on a tensor of
    the graph, the targets' ``scatter_`` and ``masked_fill_``, ``tensor * s + tensor.detach() * (1 - s)``: nothing
    to say, and the same weights."""
    assert same(quietly(muzero, check, scaling), muzero(None, scaling))


@pytest.mark.parametrize("check", ["always", "auto"])
def test_muzero_sums_of_losses_kept_across_steps_are_stopped_at_the_second_step(check):
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `local (value|reward|policy)_loss`"):
        muzero_sums_kept(check)


def test_muzero_sums_of_losses_kept_across_steps_are_told_to_start_again():
    """The three sums, started again after each backward as the first fix says, train as ``update_weights`` does.
    Detaching them at the end of each step (the fix for a recurrent state) would train the same weights, but leave
    every earlier step's values in them: the loss and the value, reward and policy losses it logs would grow."""
    with pytest.raises(CarriedGraphError) as caught:
        muzero_sums_kept("always")
    assert caught.value.fixes[0].startswith("start the sum again after each backward (`policy_loss = 0; value_loss = "
                                            "0; reward_loss = 0`)"), caught.value.fixes[0]
    assert same(quietly(muzero_sums_kept, "always", started_again=True), muzero(None))


# World Models' MDN-RNN trained on the latents of a VAE trained before (ctallec/world-models, trainmdrnn.py,
# models/mdrnn.py): `to_latent` encodes the observations under torch.no_grad(); the optimizer holds the MDN-RNN only

class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.mu, self.logsigma, self.decoder = (nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3),
                                                              nn.Linear(3, 6))

    def forward(self, x):
        h = F.relu(self.encoder(x))
        mu, logsigma = self.mu(h), self.logsigma(h)
        return self.decoder(mu + logsigma.exp() * torch.randn_like(mu)), mu, logsigma


class MDRNN(nn.Module):
    def __init__(self, latents=3, actions=2, hiddens=5, gaussians=2):
        super().__init__()
        self.latents, self.gaussians = latents, gaussians
        self.rnn, self.gmm_linear = nn.LSTM(latents + actions, hiddens), nn.Linear(hiddens, (2 * latents + 1) * 2 + 2)

    def forward(self, actions, latents):
        seq_len, bs = actions.size(0), actions.size(1)
        outs, _ = self.rnn(torch.cat([actions, latents], dim=-1))
        gmm_outs = self.gmm_linear(outs)
        stride = self.gaussians * self.latents
        mus = gmm_outs[:, :, :stride].view(seq_len, bs, self.gaussians, self.latents)
        sigmas = torch.exp(gmm_outs[:, :, stride:2 * stride].view(seq_len, bs, self.gaussians, self.latents))
        logpi = F.log_softmax(gmm_outs[:, :, 2 * stride: 2 * stride + self.gaussians].view(seq_len, bs, -1), dim=-1)
        return mus, sigmas, logpi, gmm_outs[:, :, -2], gmm_outs[:, :, -1]


def gmm_loss(batch, mus, sigmas, logpi):
    g_log_probs = logpi + torch.sum(torch.distributions.Normal(mus, sigmas).log_prob(batch.unsqueeze(-2)), dim=-1)
    max_log_probs = torch.max(g_log_probs, dim=-1, keepdim=True)[0]
    probs = torch.sum(torch.exp(g_log_probs - max_log_probs), dim=-1)
    return - torch.mean(max_log_probs.squeeze() + torch.log(probs))


def world_model_mdrnn(check: str | None, no_grad: bool = True) -> tuple[list[torch.Tensor], float]:
    """Four batches of two sequences of five steps; ``no_grad``: ``to_latent`` as trainmdrnn.py writes it."""
    torch.manual_seed(0)
    vae, mdrnn = VAE(), MDRNN()
    optimizer = torch.optim.RMSprop(mdrnn.parameters(), lr=1e-3, alpha=.9)
    guard = GraphGuard(mdrnn, optimizer, check=check) if check else None

    def to_latent(obs, next_obs):
        with torch.no_grad() if no_grad else torch.enable_grad():
            (obs_mu, obs_logsigma), (next_obs_mu, next_obs_logsigma) = [vae(x)[1:] for x in (obs, next_obs)]
            return [(x_mu + x_logsigma.exp() * torch.randn_like(x_mu)).view(2, 5, 3) for x_mu, x_logsigma in
                    [(obs_mu, obs_logsigma), (next_obs_mu, next_obs_logsigma)]]

    cum_loss = 0
    for _ in range(4):
        obs, action, reward = torch.randn(2, 5, 6), torch.randn(2, 5, 2), torch.randn(2, 5)
        terminal, next_obs = (torch.rand(2, 5) < 0.2).float(), torch.randn(2, 5, 6)
        latent_obs, latent_next_obs = to_latent(obs.view(-1, 6), next_obs.view(-1, 6))
        latent_obs, action, reward, terminal, latent_next_obs = [
            arr.transpose(1, 0) for arr in [latent_obs, action, reward, terminal, latent_next_obs]]
        mus, sigmas, logpi, rs, ds = mdrnn(action, latent_obs)
        losses = dict(gmm=gmm_loss(latent_next_obs, mus, sigmas, logpi),
                      bce=F.binary_cross_entropy_with_logits(ds, terminal), mse=F.mse_loss(rs, reward))
        losses["loss"] = (losses["gmm"] + losses["bce"] + losses["mse"]) / (3 + 2)
        optimizer.zero_grad()
        guard.backward(losses["loss"]) if guard else losses["loss"].backward()
        optimizer.step()
        cum_loss += losses["loss"].item()
    return [p.detach().clone() for p in mdrnn.parameters()], cum_loss


@pytest.mark.parametrize("check", MODES)
def test_world_model_mdrnn_on_latents_encoded_under_no_grad_is_quiet_and_bit_identical(check):
    ours, bare = quietly(world_model_mdrnn, check), world_model_mdrnn(None)
    assert same(ours[0], bare[0]) and ours[1] == bare[1]


@pytest.mark.parametrize("check", MODES)
def test_world_model_latents_encoded_with_grad_are_quiet_as_a_part_left_out_of_the_optimizer(check):
    """Without ``to_latent``'s ``torch.no_grad()`` the MDN-RNN's loss reaches the VAE, whose parameters no optimizer
    holds: each backward runs through the encoder and adds to its gradients, which nothing reads, and the MDN-RNN
    trains the same. The guard stays quiet, as for a head fine-tuned with its encoder left requiring grad (a part of
    the model left out of the optimizer on purpose, docs/guard.md): a cost, not a wrong result."""
    ours, bare = quietly(world_model_mdrnn, check, no_grad=False), world_model_mdrnn(None, no_grad=False)
    assert same(ours[0], bare[0]) and ours[1] == bare[1]


def test_a_state_integrated_step_after_step_is_still_told_to_be_detached():
    """`pos = pos + dt * f(x)` kept across steps: an addition only additions take, but of no loss; a state, detached."""
    torch.manual_seed(0)
    net = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    guard = GraphGuard(net, optimizer, check="always")
    pos = torch.zeros(3, 2)
    with pytest.raises(CarriedGraphError) as caught:
        for _ in range(3):
            pos = pos + 0.1 * net(torch.randn(3, 2))
            loss = (pos ** 2).mean()
            optimizer.zero_grad()
            guard.backward(loss)
            optimizer.step()
    assert caught.value.fixes[0].startswith("detach the carried state at the end of each step (`pos = pos.detach()`)")


def test_a_state_written_into_the_first_slot_of_this_steps_solution_is_named_not_the_solution():
    """torchdiffeq's ``odeint`` (tests/libraries/test_torchdiffeq_real.py, with torchdiffeq): each window's solution
    is a new tensor whose first slot is the state carried from the last window, ``y0 = pred_y[-1]`` kept with its
    graph. The loss reaches the last window's graph only through that slot, but the solution is this step's own, no
    buffer kept across steps: the state is named, and told to be detached."""
    torch.manual_seed(0)
    net = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    guard = GraphGuard(net, optimizer, check="always")
    y0 = torch.ones(2)
    with pytest.raises(CarriedGraphError) as caught:
        for _ in range(3):
            pred_y = torch.empty(4, 2)
            pred_y[0] = y = y0
            for i in range(1, 4):  # the solver's steps, written into the solution's slots
                y = y + 0.1 * net(y)
                pred_y[i] = y
            loss = pred_y.abs().mean()
            optimizer.zero_grad()
            guard.backward(loss)
            optimizer.step()
            y0 = pred_y[-1]
    assert "held by `local y0`" in str(caught.value)
    assert caught.value.fixes[0].startswith("detach the carried state at the end of each step (`y0 = y0.detach()`)")
