"""First-order meta-learning with Reptile on sine waves: JosephKJ/PyTorch-MAML-and-Reptile, main.py
(``run='Reptile'``; adapted from John Schulman's gist for OpenAI's Reptile post). Each outer
iteration draws a sine task from a numpy ``RandomState``, saves ``weights_before =
deepcopy(model.state_dict())``, runs inner SGD on the task by hand (``model.zero_grad()``,
``loss.backward()``, ``param.data -= innerstepsize * param.grad.data``), then moves the weights only
part of the way to the task's: ``model.load_state_dict`` of ``weights_before + (weights_after -
weights_before) * outerstepsize``, with ``outerstepsize`` annealed linearly to zero."""
from copy import deepcopy

import numpy as np
import pytest
import torch
from torch import nn

from safeloop import Trainer

from .harness import checks, compare, fixed

# the source's step sizes; 40 points in minibatches of 10, the last 10 held out: 3 inner updates a task
INNER_STEP_SIZE, OUTER_STEP_SIZE, N_TRAIN, ITERATIONS = 0.02, 0.1, 10, 5
x_all = np.linspace(-5, 5, 40)[:, None]


def sine_net():
    """The source's model (Tanh, as it chose over the paper's ReLU), 16 wide instead of 64."""
    return nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def sine_tasks(n):
    """Each outer iteration's inner minibatches, drawn from the source's ``RandomState(0)`` in its order
    (phase, amplitude, permutation). Nothing here depends on the model, so drawing them up front gives
    both loops the same tasks."""
    rng = np.random.RandomState(0)
    tasks = []
    for _ in range(n):
        phase, ampl = rng.uniform(low=0, high=2 * np.pi), rng.uniform(0.1, 5)
        y_all = np.sin(x_all + phase) * ampl
        train_ind = rng.permutation(len(x_all))[:-1 * N_TRAIN]
        tasks.append([(x_all[train_ind[start:start + N_TRAIN]], y_all[train_ind[start:start + N_TRAIN]])
                      for start in range(0, len(train_ind), N_TRAIN)])
    return tasks


def inner_loss(model, x, y):
    ypred = model(torch.Tensor(x))  # the source's to_torch; its Variable() is a no-op since torch 0.4
    return (ypred - torch.Tensor(y)).pow(2).mean()


def sgd_by_hand(model):
    for param in model.parameters():
        param.data -= INNER_STEP_SIZE * param.grad.data


def interpolated(weights_before, weights_after, iteration):
    outerstepsize = OUTER_STEP_SIZE * (1 - iteration / ITERATIONS)  # linear schedule
    return {name: weights_before[name] + (weights_after[name] - weights_before[name]) * outerstepsize
            for name in weights_before}


def reptile_hand(model, tasks):
    for iteration, minibatches in enumerate(tasks):
        weights_before = deepcopy(model.state_dict())
        for x, y in minibatches:  # train_on_batch
            model.zero_grad()
            loss = inner_loss(model, x, y)
            loss.backward()
            sgd_by_hand(model)
        # weights_after shares the parameters' storage: the interpolation reads them before loading
        model.load_state_dict(interpolated(weights_before, model.state_dict(), iteration))


class Reptile(Trainer):
    """One Trainer step is one outer iteration. The inner update stays by hand: ``torch.optim.SGD``
    computes ``param.add_(grad, alpha=-lr)``, which rounds differently from ``param.data -= lr * grad``
    (1 ulp apart on CPU), so manual mode's ``self.step()`` would not train the source's weights. The
    SGD optimizer the Trainer is given is never stepped: it names the parameters ``self.backward``
    back-propagates into and the guard watches."""

    automatic = False

    def training_step(self, minibatches):
        weights_before = deepcopy(self.model.state_dict())
        for x, y in minibatches:
            self.model.zero_grad()
            loss = inner_loss(self.model, x, y)
            self.backward(loss)
            sgd_by_hand(self.model)
        self.model.load_state_dict(interpolated(weights_before, self.model.state_dict(), self.state.step))
        return loss


@pytest.mark.parametrize("check", checks())
def test_reptile_on_sine_waves(check):
    compare(sine_net, reptile_hand, Reptile, fixed(sine_tasks(ITERATIONS)), check, steps=ITERATIONS,
            optimizer=lambda p: torch.optim.SGD(p, lr=INNER_STEP_SIZE))
