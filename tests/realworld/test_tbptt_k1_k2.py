"""Truncated backpropagation through time with separate k1 and k2, by chained backwards: Alban Desmaison's
``TBPTT`` class, https://discuss.pytorch.org/t/implementing-truncated-backpropagation-through-time/15500/4, as
copied into public repositories (e.g. the ``TBPTT`` class "implemented by Alban Desmaison" with that link).

Every time step runs the one-step module on a new leaf: the previous state ``.detach()``-ed with
``requires_grad = True``, and keeps ``(leaf, new_state)`` in a list of the last ``k2`` steps. Every ``k1`` steps the
loss on the last output is back-propagated, then, going back in time, each earlier ``new_state`` is
back-propagated with the gradient its successor's leaf received (``states[-i-2][1].backward(curr_grad)``): up to
``k2`` backwards per update, each through one step's graph, and ``optimizer.step()``. The list still holds the
last window's states, whose graphs those backwards freed, while the next window's steps are appended. The module
registers a printing hook on each of its outputs.

Changes for a seconds-long test: ``layer_size`` 3 (50), a batch of 4 (200), 9 time steps (20), ``k1 = k2 = 3``
(5 and 7: with ``k1 < k2`` the retained graphs saved the weights that ``optimizer.step()`` then changes, and
PyTorch refuses the next backward); ``self.optimizer`` for the module-level ``optimizer`` the class reads; no
timing print; the hooks print nothing.

The port's step is one window of ``k1`` time steps; the data iterator yields the windows. ``Trainer.backward``
takes no ``gradient=``, so each ``new_state.backward(curr_grad)`` is written ``self.backward((new_state *
curr_grad).sum())``, which gives the same gradients bit for bit.
"""
import pytest
import torch
from torch import nn

from safeloop import Trainer

from .harness import checks, compare

seq_len = 9
layer_size = 3
K1 = K2 = 3

idx = 0


class TBPTT():
    def __init__(self, one_step_module, loss_module, k1, k2, optimizer):
        self.one_step_module = one_step_module
        self.loss_module = loss_module
        self.k1 = k1
        self.k2 = k2
        self.retain_graph = k1 < k2
        # You can also remove all the optimizer code here, and the
        # train function will just accumulate all the gradients in
        # one_step_module parameters
        self.optimizer = optimizer

    def train(self, input_sequence, init_state):
        states = [(None, init_state)]
        for j, (inp, target) in enumerate(input_sequence):

            state = states[-1][1].detach()
            state.requires_grad=True
            output, new_state = self.one_step_module(inp, state)
            states.append((state, new_state))

            while len(states) > self.k2:
                # Delete stuff that is too old
                del states[0]

            if (j+1)%self.k1 == 0:
                loss = self.loss_module(output, target)

                self.optimizer.zero_grad()
                # backprop last module (keep graph only if they ever overlap)
                loss.backward(retain_graph=self.retain_graph)
                for i in range(self.k2-1):
                    # if we get all the way back to the "init_state", stop
                    if states[-i-2][0] is None:
                        break
                    curr_grad = states[-i-1][0].grad
                    states[-i-2][1].backward(curr_grad, retain_graph=self.retain_graph)
                self.optimizer.step()


class MyMod(nn.Module):
    def __init__(self):
        super(MyMod, self).__init__()
        self.lin = nn.Linear(2*layer_size, 2*layer_size)

    def forward(self, inp, state):
        global idx
        full_out = self.lin(torch.cat([inp, state], 1))
        # out, new_state = full_out.chunk(2, dim=1)
        out = full_out.narrow(1, 0, layer_size)
        new_state = full_out.narrow(1, layer_size, layer_size)
        def get_pr(idx_val):
            def pr(*args):
                pass  # print("doing backward {}".format(idx_val))
            return pr
        new_state.register_hook(get_pr(idx))
        out.register_hook(get_pr(idx))
        idx += 1
        return out, new_state


def sequence(model):
    gen = torch.Generator().manual_seed(5)
    return [(torch.rand(4, layer_size, generator=gen), torch.rand(4, layer_size, generator=gen))
            for _ in range(seq_len)]


def tbptt_hand(one_step_module, windows):
    input_sequence = windows.input_sequence
    loss_module = nn.MSELoss()
    optimizer = torch.optim.SGD(one_step_module.parameters(), lr=0.1)
    runner = TBPTT(one_step_module, loss_module, K1, K2, optimizer)
    runner.train(input_sequence, torch.zeros(4, layer_size))


class Windows:
    def __init__(self, input_sequence):
        self.input_sequence = input_sequence

    def __len__(self):
        return seq_len // K1

    def __iter__(self):
        for start in range(0, seq_len, K1):
            yield self.input_sequence[start:start + K1]


class TBPTTTrainer(Trainer):
    automatic = False

    def configure_optimizers(self):
        self.states = [(None, torch.zeros(4, layer_size))]
        self.loss_module = nn.MSELoss()
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, window):
        states = self.states
        for inp, target in window:
            state = states[-1][1].detach()
            state.requires_grad = True
            output, new_state = self.model(inp, state)
            states.append((state, new_state))
            while len(states) > K2:
                del states[0]
        loss = self.loss_module(output, target)
        self.backward(loss)
        for i in range(K2 - 1):
            if states[-i-2][0] is None:
                break
            curr_grad = states[-i-1][0].grad
            self.backward((states[-i-2][1] * curr_grad).sum())
        self.step()
        return loss


@pytest.mark.parametrize("check", checks())
def test_tbptt_with_chained_backwards_through_detached_leaves(check):
    compare(MyMod, tbptt_hand, TBPTTTrainer, lambda model: Windows(sequence(model)), check, steps=seq_len // K1)
