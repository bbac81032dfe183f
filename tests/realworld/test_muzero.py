"""MuZero's training step: werner-duvaud/muzero-general, trainer.py (``Trainer.update_weights``, ``update_lr``,
``scalar_to_support``, ``loss_function``) and models.py (``MuZeroFullyConnectedNetwork``). The dynamics function is
unrolled from the representation's hidden state over the batch's actions inside one step, each hidden state
min-max normalized; a backward hook halves the gradient at the start of each unrolled dynamics step, and hooks on
each unrolled step's losses divide their gradient by the number of unroll steps (its lambdas read the loop's ``i``
when backward runs, as the source's do). The learning rate decays every step through the param groups. A second hand
loop scales the hidden state's gradient as the MuZero paper's pseudocode does, ``x * s + x.detach() * (1 - s)``.

Changes for a seconds-long test: fully connected networks of 8 hidden units, a support of 2, 3 unroll steps over
batches of 4 synthetic positions, 5 steps.

Ports: ``training_step`` builds the same predictions and losses and returns the total; the rate decay moves to
``on_step_start``.
"""
import pytest
import torch

from safeloop import Trainer

from .harness import checks, compare, fixed

OBS, ENC, ACTIONS, SUPPORT, UNROLL, BATCH, STEPS = 6, 4, 3, 2, 3, 4, 5
LR_INIT, LR_DECAY_RATE, LR_DECAY_STEPS, VALUE_LOSS_WEIGHT = 0.02, 0.9, 10, 0.25


def mlp(i, o):
    return torch.nn.Sequential(torch.nn.Linear(i, 8), torch.nn.ELU(), torch.nn.Linear(8, o))


def normalized(encoded_state):
    min_encoded_state = encoded_state.min(1, keepdim=True)[0]
    max_encoded_state = encoded_state.max(1, keepdim=True)[0]
    scale_encoded_state = max_encoded_state - min_encoded_state
    scale_encoded_state[scale_encoded_state < 1e-5] += 1e-5
    return (encoded_state - min_encoded_state) / scale_encoded_state


class MuZeroNetwork(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.representation_network = mlp(OBS, ENC)
        self.dynamics_encoded_state_network = mlp(ENC + ACTIONS, ENC)
        self.dynamics_reward_network = mlp(ENC, 2 * SUPPORT + 1)
        self.prediction_policy_network = mlp(ENC, ACTIONS)
        self.prediction_value_network = mlp(ENC, 2 * SUPPORT + 1)

    def prediction(self, encoded_state):
        return self.prediction_policy_network(encoded_state), self.prediction_value_network(encoded_state)

    def dynamics(self, encoded_state, action):
        action_one_hot = torch.zeros((action.shape[0], ACTIONS)).float()
        action_one_hot.scatter_(1, action.long(), 1.0)
        x = torch.cat((encoded_state, action_one_hot), dim=1)
        next_encoded_state = self.dynamics_encoded_state_network(x)
        reward = self.dynamics_reward_network(next_encoded_state)
        return normalized(next_encoded_state), reward

    def initial_inference(self, observation):
        encoded_state = normalized(self.representation_network(observation))
        policy_logits, value = self.prediction(encoded_state)
        # a reward of 0 as logits of its support
        reward = torch.log(torch.zeros(1, 2 * SUPPORT + 1).scatter(1, torch.tensor([[SUPPORT]]).long(), 1.0)
                           .repeat(len(observation), 1))
        return value, reward, policy_logits, encoded_state

    def recurrent_inference(self, encoded_state, action):
        next_encoded_state, reward = self.dynamics(encoded_state, action)
        policy_logits, value = self.prediction(next_encoded_state)
        return value, reward, policy_logits, next_encoded_state


def scalar_to_support(x, support_size):
    x = torch.sign(x) * (torch.sqrt(torch.abs(x) + 1) - 1) + 0.001 * x
    x = torch.clamp(x, -support_size, support_size)
    floor = x.floor()
    prob = x - floor
    logits = torch.zeros(x.shape[0], x.shape[1], 2 * support_size + 1)
    logits.scatter_(2, (floor + support_size).long().unsqueeze(-1), (1 - prob).unsqueeze(-1))
    indexes = floor + support_size + 1
    prob = prob.masked_fill_(2 * support_size < indexes, 0.0)
    indexes = indexes.masked_fill_(2 * support_size < indexes, 0.0)
    logits.scatter_(2, indexes.long().unsqueeze(-1), prob.unsqueeze(-1))
    return logits


def loss_function(value, reward, policy_logits, target_value, target_reward, target_policy):
    value_loss = (-target_value * torch.nn.LogSoftmax(dim=1)(value)).sum(1)
    reward_loss = (-target_reward * torch.nn.LogSoftmax(dim=1)(reward)).sum(1)
    policy_loss = (-target_policy * torch.nn.LogSoftmax(dim=1)(policy_logits)).sum(1)
    return value_loss, reward_loss, policy_loss


def scale_gradient(tensor, scale):
    """The MuZero paper's pseudocode: the gradient through ``tensor`` scaled by ``scale``, its value unchanged."""
    return tensor * scale + tensor.detach() * (1 - scale)


def total_loss(model, batch, hook=True):
    """update_weights' predictions and losses, up to the total it back-propagates."""
    observation_batch, action_batch, target_value, target_reward, target_policy, gradient_scale_batch = batch
    target_value = scalar_to_support(target_value, SUPPORT)
    target_reward = scalar_to_support(target_reward, SUPPORT)
    value, reward, policy_logits, hidden_state = model.initial_inference(observation_batch)
    predictions = [(value, reward, policy_logits)]
    for i in range(1, action_batch.shape[1]):
        value, reward, policy_logits, hidden_state = model.recurrent_inference(hidden_state, action_batch[:, i])
        # Scale the gradient at the start of the dynamics function (See paper appendix Training)
        if hook:
            hidden_state.register_hook(lambda grad: grad * 0.5)
        else:
            hidden_state = scale_gradient(hidden_state, 0.5)
        predictions.append((value, reward, policy_logits))
    value_loss, reward_loss, policy_loss = (0, 0, 0)
    value, reward, policy_logits = predictions[0]
    current_value_loss, _, current_policy_loss = loss_function(
        value.squeeze(-1), reward.squeeze(-1), policy_logits, target_value[:, 0], target_reward[:, 0],
        target_policy[:, 0])
    value_loss += current_value_loss.sum()
    policy_loss += current_policy_loss.sum()
    for i in range(1, len(predictions)):
        value, reward, policy_logits = predictions[i]
        current_value_loss, current_reward_loss, current_policy_loss = loss_function(
            value.squeeze(-1), reward.squeeze(-1), policy_logits, target_value[:, i], target_reward[:, i],
            target_policy[:, i])
        # Scale gradient by the number of unroll steps (See paper appendix Training)
        current_value_loss.register_hook(lambda grad: grad / gradient_scale_batch[:, i])
        current_reward_loss.register_hook(lambda grad: grad / gradient_scale_batch[:, i])
        current_policy_loss.register_hook(lambda grad: grad / gradient_scale_batch[:, i])
        value_loss += current_value_loss.sum()
        reward_loss += current_reward_loss.sum()
        policy_loss += current_policy_loss.sum()
    # Scale the value loss, paper recommends by 0.25 (See paper appendix Reanalyze)
    value_loss *= VALUE_LOSS_WEIGHT
    return value_loss + reward_loss + policy_loss


def lr_at(training_step):
    return LR_INIT * LR_DECAY_RATE ** (training_step / LR_DECAY_STEPS)


def batches():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, OBS, generator=gen),
             torch.randint(ACTIONS, (BATCH, UNROLL + 1), generator=gen).float().unsqueeze(-1),
             torch.randn(BATCH, UNROLL + 1, generator=gen), torch.randn(BATCH, UNROLL + 1, generator=gen),
             torch.softmax(torch.randn(BATCH, UNROLL + 1, ACTIONS, generator=gen), -1),
             torch.full((BATCH, UNROLL + 1), float(UNROLL))) for _ in range(STEPS)]


def make_hand(hook):
    def hand(model, data):
        """continuous_update_weights' loop: update_lr, then update_weights."""
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=LR_INIT, weight_decay=1e-4)
        training_step = 0
        for batch in data:
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr_at(training_step)
            loss = total_loss(model, batch, hook)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            training_step += 1
    return hand


def make_port(hook):
    class Port(Trainer):
        def configure_optimizers(self):
            return torch.optim.Adam(self.model.parameters(), lr=LR_INIT, weight_decay=1e-4)

        def on_step_start(self):
            for param_group in self.optimizers["optimizer"].param_groups:
                param_group["lr"] = lr_at(self.state.step)

        def training_step(self, batch):
            return total_loss(self.model, batch, hook)
    return Port


@pytest.mark.parametrize("hook", [True, False], ids=["register_hook", "scale_gradient"])
@pytest.mark.parametrize("check", checks())
def test_muzero_unrolled_dynamics(check, hook):
    compare(MuZeroNetwork, make_hand(hook), make_port(hook), fixed(batches()), check, STEPS)
