"""Trust-region policy optimization: ikostrikov/pytorch-trpo at commit e200eb8a23b3c7941a0091efb9750dafa4b23cbb,
main.py (``select_action``, ``update_params``, the episode loop), trpo.py (``conjugate_gradients``,
``linesearch``, ``trpo_step``), models.py (``Policy``, ``Value``), utils.py, running_state.py (``ZFilter``) and
replay_memory.py (``Memory``).

No ``torch.optim`` optimizer at all:

- the policy's update is a natural-gradient step: ``torch.autograd.grad`` of the surrogate loss, then 10
  conjugate-gradient iterations whose Fisher-vector products are Hessian-vector products of the KL, two
  ``torch.autograd.grad`` calls each (the first with ``create_graph=True``, its output dotted with the vector
  and differentiated again), each on a fresh forward; a backtracking line search evaluates the loss under
  ``no_grad`` at candidate weights written by ``param.data.copy_`` (``set_flat_params_to``) and leaves the
  accepted ones;
- the value net is fitted by L-BFGS over its flat parameters: each evaluation writes them through
  ``param.data.copy_``, zeroes the gradients in place (``param.grad.data.fill_(0)``), runs a forward, adds an
  L2 term per parameter in place (``value_loss += ...``) and calls ``value_loss.backward()``, then reads the
  gradient flat;
- the rollouts run the policy without ``no_grad``: every action's graph is built and dropped;
- the whole run in float64 (``torch.set_default_tensor_type('torch.DoubleTensor')``).

There is no optimizer to hand a ``safeloop.Trainer``: the case runs the source's loop and the same loop under
``python -m safeloop.watch``'s guard, and asserts both nets bit-identical.

Changes for a seconds-long test: a linear 3-state, 2-action environment with quadratic costs and 6-step
episodes stands in for gym's Reacher (its noise from NumPy's global RNG), batches of 24 environment steps
(15000), hidden layers of 8 (64), 3 policy updates; scipy's ``fmin_l_bfgs_b`` (not installed here) is
replaced by ``fmin_l_bfgs_b`` below, a fixed-step gradient descent with the same call (``func(x) -> (f, g)``
on float64 NumPy arrays, ``maxiter``) and return; ``set_default_tensor_type`` is restored afterwards; the
``backcompat`` warnings switches are left out; the prints are left out (the line search's and trpo_step's).
"""
import math
import warnings
from collections import namedtuple
from itertools import count

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.autograd import Variable

from safeloop import GraphGuard
from safeloop.watch import Watch

from .harness import CHECKS, assert_same, strict

HIDDEN, BATCH_STEPS, UPDATES, NUM_INPUTS, NUM_ACTIONS = 8, 24, 3, 3, 2
args = type("args", (), dict(gamma=0.995, tau=0.97, l2_reg=1e-3, max_kl=1e-2, damping=1e-1, batch_size=BATCH_STEPS))


def fmin_l_bfgs_b(func, x0, maxiter=15000, lr=0.1):
    """Stands in for scipy.optimize.fmin_l_bfgs_b: ``maxiter`` gradient steps; returns (x, f, info)."""
    x = x0.copy()
    for _ in range(maxiter):
        f, g = func(x)
        x = x - lr * g
    return x, func(x)[0], {}


# -- models.py --------------------------------------------------------------------------------------------
class Policy(nn.Module):
    def __init__(self, num_inputs, num_outputs):
        super(Policy, self).__init__()
        self.affine1 = nn.Linear(num_inputs, HIDDEN)  # 64
        self.affine2 = nn.Linear(HIDDEN, HIDDEN)

        self.action_mean = nn.Linear(HIDDEN, num_outputs)
        self.action_mean.weight.data.mul_(0.1)
        self.action_mean.bias.data.mul_(0.0)

        self.action_log_std = nn.Parameter(torch.zeros(1, num_outputs))

        self.saved_actions = []
        self.rewards = []
        self.final_value = 0

    def forward(self, x):
        x = torch.tanh(self.affine1(x))
        x = torch.tanh(self.affine2(x))

        action_mean = self.action_mean(x)
        action_log_std = self.action_log_std.expand_as(action_mean)
        action_std = torch.exp(action_log_std)

        return action_mean, action_log_std, action_std


class Value(nn.Module):
    def __init__(self, num_inputs):
        super(Value, self).__init__()
        self.affine1 = nn.Linear(num_inputs, HIDDEN)
        self.affine2 = nn.Linear(HIDDEN, HIDDEN)
        self.value_head = nn.Linear(HIDDEN, 1)
        self.value_head.weight.data.mul_(0.1)
        self.value_head.bias.data.mul_(0.0)

    def forward(self, x):
        x = torch.tanh(self.affine1(x))
        x = torch.tanh(self.affine2(x))

        state_values = self.value_head(x)
        return state_values


# -- utils.py ---------------------------------------------------------------------------------------------
def normal_log_density(x, mean, log_std, std):
    var = std.pow(2)
    log_density = -(x - mean).pow(2) / (
        2 * var) - 0.5 * math.log(2 * math.pi) - log_std
    return log_density.sum(1, keepdim=True)


def get_flat_params_from(model):
    params = []
    for param in model.parameters():
        params.append(param.data.view(-1))

    flat_params = torch.cat(params)
    return flat_params


def set_flat_params_to(model, flat_params):
    prev_ind = 0
    for param in model.parameters():
        flat_size = int(np.prod(list(param.size())))
        param.data.copy_(
            flat_params[prev_ind:prev_ind + flat_size].view(param.size()))
        prev_ind += flat_size


def get_flat_grad_from(net, grad_grad=False):
    grads = []
    for param in net.parameters():
        if grad_grad:
            grads.append(param.grad.grad.view(-1))
        else:
            grads.append(param.grad.view(-1))

    flat_grad = torch.cat(grads)
    return flat_grad


# -- running_state.py, replay_memory.py -------------------------------------------------------------------
class RunningStat(object):
    def __init__(self, shape):
        self._n = 0
        self._M = np.zeros(shape)
        self._S = np.zeros(shape)

    def push(self, x):
        x = np.asarray(x)
        assert x.shape == self._M.shape
        self._n += 1
        if self._n == 1:
            self._M[...] = x
        else:
            oldM = self._M.copy()
            self._M[...] = oldM + (x - oldM) / self._n
            self._S[...] = self._S + (x - oldM) * (x - self._M)

    @property
    def mean(self):
        return self._M

    @property
    def var(self):
        return self._S / (self._n - 1) if self._n > 1 else np.square(self._M)

    @property
    def std(self):
        return np.sqrt(self.var)


class ZFilter:
    def __init__(self, shape, demean=True, destd=True, clip=10.0):
        self.demean = demean
        self.destd = destd
        self.clip = clip

        self.rs = RunningStat(shape)

    def __call__(self, x, update=True):
        if update:
            self.rs.push(x)
        if self.demean:
            x = x - self.rs.mean
        if self.destd:
            x = x / (self.rs.std + 1e-8)
        if self.clip:
            x = np.clip(x, -self.clip, self.clip)
        return x


Transition = namedtuple('Transition', ('state', 'action', 'mask', 'next_state', 'reward'))


class Memory(object):
    def __init__(self):
        self.memory = []

    def push(self, *args):
        """Saves a transition."""
        self.memory.append(Transition(*args))

    def sample(self):
        return Transition(*zip(*self.memory))

    def __len__(self):
        return len(self.memory)


# -- trpo.py ----------------------------------------------------------------------------------------------
def conjugate_gradients(Avp, b, nsteps, residual_tol=1e-10):
    x = torch.zeros(b.size())
    r = b.clone()
    p = b.clone()
    rdotr = torch.dot(r, r)
    for i in range(nsteps):
        _Avp = Avp(p)
        alpha = rdotr / torch.dot(p, _Avp)
        x += alpha * p
        r -= alpha * _Avp
        new_rdotr = torch.dot(r, r)
        betta = new_rdotr / rdotr
        p = r + betta * p
        rdotr = new_rdotr
        if rdotr < residual_tol:
            break
    return x


def linesearch(model, f, x, fullstep, expected_improve_rate, max_backtracks=10, accept_ratio=.1):
    fval = f(True).data
    for (_n_backtracks, stepfrac) in enumerate(.5**np.arange(max_backtracks)):
        xnew = x + stepfrac * fullstep
        set_flat_params_to(model, xnew)
        newfval = f(True).data
        actual_improve = fval - newfval
        expected_improve = expected_improve_rate * stepfrac
        ratio = actual_improve / expected_improve

        if ratio.item() > accept_ratio and actual_improve.item() > 0:
            return True, xnew
    return False, x


def trpo_step(model, get_loss, get_kl, max_kl, damping):
    loss = get_loss()
    grads = torch.autograd.grad(loss, model.parameters())
    loss_grad = torch.cat([grad.view(-1) for grad in grads]).data

    def Fvp(v):
        kl = get_kl()
        kl = kl.mean()

        grads = torch.autograd.grad(kl, model.parameters(), create_graph=True)
        flat_grad_kl = torch.cat([grad.view(-1) for grad in grads])

        kl_v = (flat_grad_kl * Variable(v)).sum()
        grads = torch.autograd.grad(kl_v, model.parameters())
        flat_grad_grad_kl = torch.cat([grad.contiguous().view(-1) for grad in grads]).data

        return flat_grad_grad_kl + v * damping

    stepdir = conjugate_gradients(Fvp, -loss_grad, 10)

    shs = 0.5 * (stepdir * Fvp(stepdir)).sum(0, keepdim=True)

    lm = torch.sqrt(shs / max_kl)
    fullstep = stepdir / lm[0]

    neggdotstepdir = (-loss_grad * stepdir).sum(0, keepdim=True)

    prev_params = get_flat_params_from(model)
    success, new_params = linesearch(model, get_loss, prev_params, fullstep, neggdotstepdir / lm[0])
    set_flat_params_to(model, new_params)

    return loss


# -- the environment (for gym's) --------------------------------------------------------------------------
class LinearEnv:
    """s' = A s + B a + noise, reward -|s|^2 - 0.1 |a|^2, done after 6 steps; NumPy's global RNG."""
    A = np.array([[0.9, 0.1, 0.0], [0.0, 0.9, 0.1], [0.1, 0.0, 0.9]])
    B = np.array([[0.5, 0.0], [0.0, 0.5], [0.2, 0.2]])

    def reset(self):
        self.t, self.s = 0, np.random.randn(NUM_INPUTS)
        return self.s

    def step(self, action):
        self.t += 1
        reward = -float(self.s @ self.s) - 0.1 * float(action @ action)
        self.s = self.A @ self.s + self.B @ action + 0.05 * np.random.randn(NUM_INPUTS)
        return self.s, reward, self.t >= 6, {}


# -- main.py ----------------------------------------------------------------------------------------------
def trpo_hand(policy_net, value_net, env):
    def select_action(state):
        state = torch.from_numpy(state).unsqueeze(0)
        action_mean, _, action_std = policy_net(Variable(state))
        action = torch.normal(action_mean, action_std)
        return action

    def update_params(batch):
        rewards = torch.Tensor(batch.reward)
        masks = torch.Tensor(batch.mask)
        actions = torch.Tensor(np.concatenate(batch.action, 0))
        states = torch.Tensor(batch.state)
        values = value_net(Variable(states))

        returns = torch.Tensor(actions.size(0), 1)
        deltas = torch.Tensor(actions.size(0), 1)
        advantages = torch.Tensor(actions.size(0), 1)

        prev_return = 0
        prev_value = 0
        prev_advantage = 0
        for i in reversed(range(rewards.size(0))):
            returns[i] = rewards[i] + args.gamma * prev_return * masks[i]
            deltas[i] = rewards[i] + args.gamma * prev_value * masks[i] - values.data[i]
            advantages[i] = deltas[i] + args.gamma * args.tau * prev_advantage * masks[i]

            prev_return = returns[i, 0]
            prev_value = values.data[i, 0]
            prev_advantage = advantages[i, 0]

        targets = Variable(returns)

        # Original code uses the same LBFGS to optimize the value loss
        def get_value_loss(flat_params):
            set_flat_params_to(value_net, torch.Tensor(flat_params))
            for param in value_net.parameters():
                if param.grad is not None:
                    param.grad.data.fill_(0)

            values_ = value_net(Variable(states))

            value_loss = (values_ - targets).pow(2).mean()

            # weight decay
            for param in value_net.parameters():
                value_loss += param.pow(2).sum() * args.l2_reg
            value_loss.backward()
            return (value_loss.data.double().numpy(), get_flat_grad_from(value_net).data.double().numpy())

        flat_params, _, opt_info = fmin_l_bfgs_b(get_value_loss, get_flat_params_from(value_net).double().numpy(),
                                                 maxiter=5)
        set_flat_params_to(value_net, torch.Tensor(flat_params))

        advantages = (advantages - advantages.mean()) / advantages.std()

        action_means, action_log_stds, action_stds = policy_net(Variable(states))
        fixed_log_prob = normal_log_density(Variable(actions), action_means, action_log_stds, action_stds).data.clone()

        def get_loss(volatile=False):
            if volatile:
                with torch.no_grad():
                    action_means, action_log_stds, action_stds = policy_net(Variable(states))
            else:
                action_means, action_log_stds, action_stds = policy_net(Variable(states))

            log_prob = normal_log_density(Variable(actions), action_means, action_log_stds, action_stds)
            action_loss = -Variable(advantages) * torch.exp(log_prob - Variable(fixed_log_prob))
            return action_loss.mean()

        def get_kl():
            mean1, log_std1, std1 = policy_net(Variable(states))

            mean0 = Variable(mean1.data)
            log_std0 = Variable(log_std1.data)
            std0 = Variable(std1.data)
            kl = log_std1 - log_std0 + (std0.pow(2) + (mean0 - mean1).pow(2)) / (2.0 * std1.pow(2)) - 0.5
            return kl.sum(1, keepdim=True)

        trpo_step(policy_net, get_loss, get_kl, args.max_kl, args.damping)

    running_state = ZFilter((NUM_INPUTS,), clip=5)

    for i_episode in count(1):
        memory = Memory()

        num_steps = 0
        reward_batch = 0
        num_episodes = 0
        while num_steps < args.batch_size:
            state = env.reset()
            state = running_state(state)

            reward_sum = 0
            for t in range(10000):  # Don't infinite loop while learning
                action = select_action(state)
                action = action.data[0].numpy()
                next_state, reward, done, _ = env.step(action)
                reward_sum += reward

                next_state = running_state(next_state)

                mask = 1
                if done:
                    mask = 0

                memory.push(state, np.array([action]), mask, next_state, reward)

                if done:
                    break

                state = next_state
            num_steps += (t - 1)
            num_episodes += 1
            reward_batch += reward_sum

        reward_batch /= num_episodes
        batch = memory.sample()
        update_params(batch)
        if i_episode == UPDATES:
            break


def nets():
    torch.manual_seed(0)
    return Policy(NUM_INPUTS, NUM_ACTIONS), Value(NUM_INPUTS)


def run(watch):
    np.random.seed(0)
    torch.manual_seed(1)
    torch.set_default_tensor_type('torch.DoubleTensor')
    try:
        policy_net, value_net = nets()
        with watch() as w:
            trpo_hand(policy_net, value_net, LinearEnv())
        return policy_net, value_net, w
    finally:
        torch.set_default_tensor_type('torch.FloatTensor')


@pytest.mark.parametrize("check", CHECKS)
def test_trpo_under_watch(check):
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = run(lambda: _Nothing())
    with strict(own):
        watched = run(lambda: Watch(GraphGuard(check=check), trpo_hand.__code__.co_filename))
    for a, b in zip(watched[:2], ref[:2]):
        assert_same(a, b)
    start_policy, start_value = (m.double() for m in nets())
    assert not torch.equal(ref[0].affine1.weight, start_policy.affine1.weight), "the policy was not updated"
    assert not torch.equal(ref[1].affine1.weight, start_value.affine1.weight), "the value net was not fitted"


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
