"""More hand-written training loops from public code, run bare, under ``safeloop.watch``'s guard (``Watch``, in
process) and with ``safeloop.GraphGuard`` written into the loop, in every guard mode: parameters must come out bit
for bit the same, with no warning and no error. These loops stress where a step begins: forwards collected over an
episode on the module itself, a first backward after several iterations, a step run by a closure or a method.
"""
import re
import warnings
from collections import deque, namedtuple
from copy import deepcopy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

from safeloop import GraphGuard
from safeloop.errors import CarriedGraphError
from safeloop.errors import GraphLeakWarning

from .harness import checks
from .test_hand_loops_real import hooks, three_runs, watched


class Walk:
    """A deterministic four-feature environment: ``reset`` and ``step`` as gym's, episodes of ``length`` steps."""

    def __init__(self, length=5):
        self.length = length

    def reset(self):
        self.t, self.state = 0, np.random.randn(4)
        return self.state, {}

    def step(self, action):
        self.t += 1
        self.state = np.tanh(self.state + (0.5 if action else -0.5))
        return self.state, float(self.state.sum() > 0), self.t >= self.length, False, {}


# -- pytorch/examples: reinforcement_learning/reinforce.py --------------------------------------------------------
class Policy(nn.Module):
    def __init__(self):
        super(Policy, self).__init__()
        self.affine1 = nn.Linear(4, 16)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(16, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


def reinforce_build():
    policy = Policy()
    return policy, torch.optim.Adam(policy.parameters(), lr=1e-2), Walk()


def reinforce_train(policy, optimizer, env, episodes=4, gamma=0.99, guard=None):
    step, backward = hooks(guard)
    eps = np.finfo(np.float32).eps.item()

    def select_action(state):
        state = torch.from_numpy(state).float().unsqueeze(0)
        probs = policy(state)
        m = Categorical(probs)
        action = m.sample()
        policy.saved_log_probs.append(m.log_prob(action))
        return action.item()

    def finish_episode():
        R = 0
        policy_loss = []
        returns = deque()
        for r in policy.rewards[::-1]:
            R = r + gamma * R
            returns.appendleft(R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)
        for log_prob, R in zip(policy.saved_log_probs, returns):
            policy_loss.append(-log_prob * R)
        optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        backward(policy_loss)
        optimizer.step()
        del policy.rewards[:]
        del policy.saved_log_probs[:]

    running_reward = 10
    for i_episode in range(episodes):
        with step():
            state, _ = env.reset()
            ep_reward = 0
            for t in range(1, 10000):
                action = select_action(state)
                state, reward, done, _, _ = env.step(action)
                policy.rewards.append(reward)
                ep_reward += reward
                if done:
                    break
            running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
            finish_episode()
    return policy, running_reward


@pytest.mark.parametrize("check", checks())
def test_reinforce_log_probs_kept_on_the_policy_until_the_episode_ends(check):
    """pytorch/examples, reinforcement_learning/reinforce.py: ``select_action`` appends each step's log-prob to
    ``policy.saved_log_probs``; ``finish_episode`` runs one backward over the episode and clears the list."""
    three_runs(reinforce_build, reinforce_train, check)


# -- pytorch/examples: reinforcement_learning/actor_critic.py -----------------------------------------------------
SavedAction = namedtuple('SavedAction', ['log_prob', 'value'])


class ActorCritic(nn.Module):
    def __init__(self):
        super(ActorCritic, self).__init__()
        self.affine1 = nn.Linear(4, 16)
        self.action_head = nn.Linear(16, 2)
        self.value_head = nn.Linear(16, 1)
        self.saved_actions = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.affine1(x))
        action_prob = F.softmax(self.action_head(x), dim=-1)
        state_values = self.value_head(x)
        return action_prob, state_values


def ac_build():
    model = ActorCritic()
    return model, torch.optim.Adam(model.parameters(), lr=3e-2), Walk()


def ac_train(model, optimizer, env, episodes=4, gamma=0.99, guard=None):
    step, backward = hooks(guard)
    eps = np.finfo(np.float32).eps.item()

    def select_action(state):
        state = torch.from_numpy(state).float()
        probs, state_value = model(state)
        m = Categorical(probs)
        action = m.sample()
        model.saved_actions.append(SavedAction(m.log_prob(action), state_value))
        return action.item()

    def finish_episode():
        R = 0
        saved_actions = model.saved_actions
        policy_losses = []
        value_losses = []
        returns = []
        for r in model.rewards[::-1]:
            R = r + gamma * R
            returns.insert(0, R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)
        for (log_prob, value), R in zip(saved_actions, returns):
            advantage = R - value.item()
            policy_losses.append(-log_prob * advantage)
            value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
        optimizer.zero_grad()
        loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
        backward(loss)
        optimizer.step()
        del model.rewards[:]
        del model.saved_actions[:]

    for i_episode in range(episodes):
        with step():
            state, _ = env.reset()
            for t in range(1, 10000):
                action = select_action(state)
                state, reward, done, _, _ = env.step(action)
                model.rewards.append(reward)
                if done:
                    break
            finish_episode()
    return (model,)


@pytest.mark.parametrize("check", checks())
def test_actor_critic_saved_actions_and_values_kept_on_the_model(check):
    """pytorch/examples, reinforcement_learning/actor_critic.py: ``model.saved_actions`` holds (log_prob, value)
    pairs with their graphs for a whole episode; one backward of the summed actor and critic losses."""
    three_runs(ac_build, ac_train, check)


# -- losses kept in a list for K iterations, one backward of their mean; a running loss for logging ---------------
def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def regression_build(n=8):
    gen = torch.Generator().manual_seed(3)
    model = mlp()
    data = [(torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(n)]
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data


def stacked_train(model, opt, data, k=3, guard=None, per_iteration=False):
    step, backward = hooks(guard if per_iteration else None)
    backward = guard.backward if guard is not None else backward
    losses = []
    for i, (x, y) in enumerate(data):
        with step():
            losses.append(F.mse_loss(model(x), y))
            if len(losses) == k:
                backward(torch.stack(losses).mean())
                opt.step()
                opt.zero_grad()
                losses = []
    return (model,)


@pytest.mark.parametrize("check", checks())
def test_losses_kept_in_a_list_for_three_iterations_then_one_backward_of_their_mean(check):
    """A meta-batch loop as in learn2learn's and higher's examples (``torch.stack(losses).mean().backward()``): the
    first backward comes at the third iteration, its graph made over three of them."""
    three_runs(regression_build, stacked_train, check)


def test_losses_kept_in_a_list_with_a_guard_step_per_iteration_are_said_to_need_one_step():
    """As above, with ``with guard.step():`` around each iteration: the third step's loss reaches the graphs of the two
    steps before, which the guard's steps say must not share graphs. Stopped before its backward, the error says to
    let one step span the iterations the loss is built over (detaching at the append would leave no gradient)."""
    torch.manual_seed(0)
    model, opt, data = regression_build()
    start = deepcopy(model)
    with pytest.raises(CarriedGraphError, match=r"held by `local losses\[\d\]`.*let one step span the iterations"):
        stacked_train(model, opt, data, guard=GraphGuard(), per_iteration=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))


def running_train(model, opt, data, how="item", epochs=2, guard=None):
    step, backward = hooks(guard)
    history = []
    for epoch in range(epochs):
        running_loss = 0.0
        for i, (x, y) in enumerate(data):
            with step():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                backward(loss)
                opt.step()
                running_loss += loss.item() if how == "item" else loss.detach() if how == "detach" else loss
        history.append(float(running_loss) / len(data))
    return model, history


@pytest.mark.parametrize("how", ["item", "detach"])
@pytest.mark.parametrize("check", checks())
def test_running_loss_reset_each_epoch(check, how):
    """pytorch/tutorials, beginner_source/blitz/cifar10_tutorial.py: ``running_loss += loss.item()`` reset at
    each epoch; and the same with ``loss.detach()``, a tensor without a graph."""
    three_runs(regression_build, lambda *a, guard=None: running_train(*a, how=how, guard=guard), check)


def test_running_loss_kept_with_its_graph_is_named():
    """``running_loss += loss``: every step's graph chained into one tensor for the epoch, a true leak; the guard
    names ``running_loss``, under ``watch`` and in ``GraphGuard``."""
    for guard in (None, GraphGuard(check="always")):
        torch.manual_seed(0)
        model, opt, data = regression_build()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if guard is None:
                watched(running_train, model, opt, data, "graph")
            else:
                running_train(model, opt, data, "graph", guard=guard)
        leaks = [str(w.message) for w in caught if issubclass(w.category, GraphLeakWarning)]
        assert any(re.search(r"running_loss", text) for text in leaks), leaks


# -- huggingface/transformers: examples/pytorch/language-modeling/run_clm_no_trainer.py (v4.2x) ------------------
class TinyCausalLM(nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        logits = self.lm_head(torch.tanh(self.wte(input_ids)))
        shift_logits, shift_labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return namedtuple("CausalLMOutput", ["loss", "logits"])(loss, logits)


def clm_build(n=7):
    gen = torch.Generator().manual_seed(5)
    model = TinyCausalLM()
    ids = [torch.randint(11, (2, 6), generator=gen) for _ in range(n)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / 10)
    return model, optimizer, lr_scheduler, [{"input_ids": i, "labels": i} for i in ids]


def clm_train(model, optimizer, lr_scheduler, train_dataloader, gradient_accumulation_steps=2, max_train_steps=3,
              num_train_epochs=2, guard=None):
    _, backward = hooks(guard)
    completed_steps = 0
    losses = []
    for epoch in range(num_train_epochs):
        model.train()
        total_loss = 0
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            total_loss += loss.detach().float()
            loss = loss / gradient_accumulation_steps
            backward(loss)
            if step % gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
            if completed_steps >= max_train_steps:
                break
        losses.append(total_loss.item())
    return model, completed_steps, losses


@pytest.mark.parametrize("check", checks())
def test_run_clm_no_trainer_accumulation_with_completed_steps(check):
    """huggingface/transformers, examples/pytorch/language-modeling/run_clm_no_trainer.py (before
    ``accelerator.accumulate``): ``loss / gradient_accumulation_steps``, an update at ``step % n == 0`` (so the
    first after one backward, later ones after two), ``completed_steps`` breaking the epoch, ``total_loss`` kept
    as a detached tensor."""
    three_runs(clm_build, clm_train, check)


# -- huggingface/diffusers: examples/unconditional_image_generation/train_unconditional.py, training_utils.EMAModel -
class EMAModel:
    def __init__(self, parameters, decay=0.9999, min_decay=0.0, update_after_step=0, use_ema_warmup=True,
                 inv_gamma=1.0, power=2 / 3):
        parameters = list(parameters)
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.use_ema_warmup, self.inv_gamma, self.power = use_ema_warmup, inv_gamma, power
        self.optimization_step = 0

    def get_decay(self, optimization_step):
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:
            cur_decay_value = 1 - (1 + step / self.inv_gamma) ** -self.power
        else:
            cur_decay_value = (1 + step) / (10 + step)
        cur_decay_value = min(cur_decay_value, self.decay)
        cur_decay_value = max(cur_decay_value, self.min_decay)
        return cur_decay_value

    @torch.no_grad()
    def step(self, parameters):
        parameters = list(parameters)
        self.optimization_step += 1
        one_minus_decay = 1 - self.get_decay(self.optimization_step)
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)


class DDPMScheduler:
    """diffusers' DDPMScheduler.add_noise with a linear beta schedule."""

    def __init__(self, num_train_timesteps=10):
        self.num_train_timesteps = num_train_timesteps
        self.betas = torch.linspace(1e-4, 0.02, num_train_timesteps, dtype=torch.float32)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)

    def add_noise(self, original_samples, noise, timesteps):
        sqrt_alpha_prod = self.alphas_cumprod[timesteps] ** 0.5
        sqrt_alpha_prod = sqrt_alpha_prod.flatten()
        while len(sqrt_alpha_prod.shape) < len(original_samples.shape):
            sqrt_alpha_prod = sqrt_alpha_prod.unsqueeze(-1)
        sqrt_one_minus_alpha_prod = (1 - self.alphas_cumprod[timesteps]) ** 0.5
        sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.flatten()
        while len(sqrt_one_minus_alpha_prod.shape) < len(original_samples.shape):
            sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.unsqueeze(-1)
        return sqrt_alpha_prod * original_samples + sqrt_one_minus_alpha_prod * noise


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.time = nn.Embedding(10, 4)
        self.conv_in = nn.Conv2d(1, 4, 3, padding=1)
        self.conv_out = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x, t):
        h = F.silu(self.conv_in(x) + self.time(t)[:, :, None, None])
        return namedtuple("UNet2DOutput", ["sample"])(self.conv_out(h))


def diffusion_build(n=6):
    gen = torch.Generator().manual_seed(6)
    model = TinyUNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema_model = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=3 / 4)
    return model, optimizer, ema_model, DDPMScheduler(), [torch.randn(2, 1, 4, 4, generator=gen) for _ in range(n)]


def diffusion_train(model, optimizer, ema_model, noise_scheduler, train_dataloader, gradient_accumulation_steps=2,
                    guard=None):
    step, backward = hooks(guard)
    global_step = 0
    for i, clean_images in enumerate(train_dataloader):
        with step():
            noise = torch.randn(clean_images.shape)
            bsz = clean_images.shape[0]
            timesteps = torch.randint(0, noise_scheduler.num_train_timesteps, (bsz,)).long()
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
            model_output = model(noisy_images, timesteps).sample
            loss = F.mse_loss(model_output.float(), noise.float()) / gradient_accumulation_steps
            backward(loss)
            if (i + 1) % gradient_accumulation_steps == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                ema_model.step(model.parameters())
                global_step += 1
    return (model, global_step, *ema_model.shadow_params)


@pytest.mark.parametrize("check", checks())
def test_diffusers_unconditional_with_ema_add_noise_and_accumulation(check):
    """huggingface/diffusers, examples/unconditional_image_generation/train_unconditional.py with
    ``training_utils.EMAModel`` and ``DDPMScheduler.add_noise``; accumulation written by hand in place of
    ``accelerator.accumulate`` (one update every two iterations, each one a ``guard.step()``)."""
    three_runs(diffusion_build, diffusion_train, check)


# -- d2l-ai/d2l-en: d2l/torch.py (train_epoch_ch3, Accumulator, accuracy, sgd) ------------------------------------
class Accumulator:
    """For accumulating sums over `n` variables."""

    def __init__(self, n):
        self.data = [0.0] * n

    def add(self, *args):
        self.data = [a + float(b) for a, b in zip(self.data, args)]

    def __getitem__(self, idx):
        return self.data[idx]


def accuracy(y_hat, y):
    if len(y_hat.shape) > 1 and y_hat.shape[1] > 1:
        y_hat = y_hat.argmax(axis=1)
    cmp = y_hat.type(y.dtype) == y
    return float(cmp.type(y.dtype).sum())


def sgd(params, lr, batch_size):
    with torch.no_grad():
        for param in params:
            param -= lr * param.grad / batch_size
            param.grad.zero_()


def d2l_build(n=5):
    gen = torch.Generator().manual_seed(7)
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    data = [(torch.randn(8, 4, generator=gen), torch.randint(3, (8,), generator=gen)) for _ in range(n)]
    return net, data


def d2l_train(net, train_iter, num_epochs=2, scratch=False, guard=None):
    step, backward = hooks(guard)
    loss = nn.CrossEntropyLoss(reduction='none')
    updater = (lambda batch_size: sgd(list(net.parameters()), 0.1, batch_size)) if scratch else \
        torch.optim.SGD(net.parameters(), lr=0.1)
    history = []
    for epoch in range(num_epochs):
        net.train()
        metric = Accumulator(3)
        for X, y in train_iter:
            with step():
                y_hat = net(X)
                l = loss(y_hat, y)  # noqa: E741 (the source's name)
                if isinstance(updater, torch.optim.Optimizer):
                    updater.zero_grad()
                    backward(l.mean())
                    updater.step()
                else:
                    backward(l.sum())
                    updater(X.shape[0])
                metric.add(float(l.sum()), accuracy(y_hat, y), y.numel())
        history.append((metric[0] / metric[2], metric[1] / metric[2]))
    return net, history


@pytest.mark.parametrize("scratch", [False, True], ids=["optimizer", "scratch_sgd"])
@pytest.mark.parametrize("check", checks())
def test_d2l_train_epoch_ch3_with_an_accumulator_of_floats(check, scratch):
    """d2l-ai/d2l-en, d2l/torch.py ``train_epoch_ch3``: ``metric.add(float(l.sum()), accuracy(y_hat, y), ...)``
    after the update, with ``torch.optim.SGD`` or the from-scratch ``d2l.sgd`` (no optimizer: in-place updates
    under ``no_grad`` and ``param.grad.zero_()``)."""
    three_runs(d2l_build, lambda *a, guard=None: d2l_train(*a, scratch=scratch, guard=guard), check)


# -- pytorch/examples: vae/main.py --------------------------------------------------------------------------------
class VAE(nn.Module):
    def __init__(self):
        super(VAE, self).__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc21 = nn.Linear(8, 2)
        self.fc22 = nn.Linear(8, 2)
        self.fc3 = nn.Linear(2, 8)
        self.fc4 = nn.Linear(8, 16)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 16))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 16), reduction='sum')
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def vae_build(n=5):
    gen = torch.Generator().manual_seed(8)
    model = VAE()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), [torch.rand(4, 1, 4, 4, generator=gen)
                                                                  for _ in range(n)]


def vae_train(model, optimizer, train_loader, epochs=2, guard=None):
    step, backward = hooks(guard)
    train_losses = []
    for epoch in range(epochs):
        model.train()
        train_loss = 0
        for batch_idx, data in enumerate(train_loader):
            with step():
                optimizer.zero_grad()
                recon_batch, mu, logvar = model(data)
                loss = loss_function(recon_batch, data, mu, logvar)
                backward(loss)
                train_loss += loss.item()
                optimizer.step()
        train_losses.append(train_loss / len(train_loader))
    return model, train_losses


@pytest.mark.parametrize("check", checks())
def test_vae_with_reparameterization_and_a_running_train_loss(check):
    """pytorch/examples, vae/main.py: ``train(epoch)``, the ELBO's BCE + KLD summed, ``train_loss += loss.item()``
    taken after the backward."""
    three_runs(vae_build, vae_train, check)


# -- whoji/training-ground: torch/quick_101/torch101_train_step.py (make_train_step) -------------------------------
def linreg_build(n=4):
    gen = torch.Generator().manual_seed(9)
    x = torch.rand(n, 10, 1, generator=gen)
    y = 1 + 2 * x + .1 * torch.randn(n, 10, 1, generator=gen)
    model = nn.Sequential(nn.Linear(1, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-1), list(zip(x, y))


def closure_train(model, optimizer, train_loader, n_epochs=3, guard=None):
    step, backward = hooks(guard)
    loss_fn = nn.MSELoss(reduction='mean')

    def make_train_step(model, loss_fn, optimizer):
        def train_step(x, y):
            model.train()
            yhat = model(x)
            loss = loss_fn(y, yhat)
            backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()
        return train_step

    train_step = make_train_step(model, loss_fn, optimizer)
    losses = []
    for epoch in range(n_epochs):
        for x_batch, y_batch in train_loader:
            with step():
                loss = train_step(x_batch, y_batch)
            losses.append(loss)
    return model, losses


@pytest.mark.parametrize("check", checks())
def test_step_defined_by_a_closure_called_from_the_loop(check):
    """whoji/training-ground, torch/quick_101/torch101_train_step.py: ``make_train_step`` returns a closure
    ``train_step(x, y)`` that runs forward, backward, step and zero_grad; the loop only calls it."""
    three_runs(linreg_build, closure_train, check)


# -- dvgodoy/PyTorchStepByStep: stepbystep/v0.py (StepByStep) ------------------------------------------------------
class StepByStep(object):
    def __init__(self, model, loss_fn, optimizer, guard=None):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.step, self.backward = hooks(guard)
        self.train_loader = None
        self.losses = []
        self.total_epochs = 0
        self.train_step_fn = self._make_train_step_fn()

    def set_loaders(self, train_loader):
        self.train_loader = train_loader

    def _make_train_step_fn(self):
        def perform_train_step_fn(x, y):
            self.model.train()
            yhat = self.model(x)
            loss = self.loss_fn(yhat, y)
            self.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()
            return loss.item()
        return perform_train_step_fn

    def _mini_batch(self):
        data_loader = self.train_loader
        step_fn = self.train_step_fn
        mini_batch_losses = []
        for x_batch, y_batch in data_loader:
            with self.step():
                mini_batch_loss = step_fn(x_batch, y_batch)
            mini_batch_losses.append(mini_batch_loss)
        loss = np.mean(mini_batch_losses)
        return loss

    def train(self, n_epochs):
        for epoch in range(n_epochs):
            self.total_epochs += 1
            loss = self._mini_batch()
            self.losses.append(loss)


def stepbystep_train(model, optimizer, train_loader, guard=None):
    sbs = StepByStep(model, nn.MSELoss(reduction='mean'), optimizer, guard=guard)
    sbs.set_loaders(train_loader)
    sbs.train(n_epochs=3)
    return model, sbs.losses, sbs.total_epochs


@pytest.mark.parametrize("check", checks())
def test_class_based_trainer_whose_method_makes_the_step_function(check):
    """dvgodoy/PyTorchStepByStep, stepbystep/v0.py: ``StepByStep.train`` loops over epochs, ``_mini_batch`` over
    batches calling ``self.train_step_fn``, a closure over ``self`` made in ``__init__``."""
    three_runs(linreg_build, stepbystep_train, check)


# -- the classic mistakes of these loops, named ----------------------------------------------------------------
def uncleared_train(policy, optimizer, env, episodes=3, guard=None):
    """``reinforce.py``'s episode loop with ``finish_episode`` missing ``del policy.saved_log_probs[:]``."""
    step, backward = hooks(guard)
    for i_episode in range(episodes):
        with step():
            state, _ = env.reset()
            for t in range(5):
                m = Categorical(policy(torch.from_numpy(state).float().unsqueeze(0)))
                action = m.sample()
                policy.saved_log_probs.append(m.log_prob(action))
                state, reward, done, _, _ = env.step(action.item())
            optimizer.zero_grad()
            policy_loss = -torch.cat(policy.saved_log_probs).sum()
            backward(policy_loss)
            optimizer.step()


def uncleared_errors():
    messages = []
    for guard in (None, GraphGuard(check="auto")):
        torch.manual_seed(0)
        np.random.seed(0)
        with pytest.raises(Exception) as caught:
            if guard is None:
                watched(uncleared_train, *reinforce_build(), check="auto")
            else:
                uncleared_train(*reinforce_build(), guard=guard)
        messages.append(str(caught.value))
    return messages


def test_reinforce_log_probs_never_cleared_are_named_before_backward():
    """The list on the policy keeps the episodes' freed graphs: the second episode's backward is stopped before
    it runs, naming ``policy.saved_log_probs``, under ``watch`` and in ``GraphGuard``."""
    for text in uncleared_errors():
        assert "policy.saved_log_probs" in text, text
        assert "second time" in text, text


def test_reinforce_log_probs_never_cleared_advise_clearing_the_list():
    """The fix for a list the loss is made from is to empty it after the backward (``del
    policy.saved_log_probs[:]``, ``.clear()``), as the source's ``finish_episode`` does."""
    for text in uncleared_errors():
        assert re.search(r"clear\(\)|del policy\.saved_log_probs\[:\]", text), text


def leaky_closure_train(model, optimizer, train_loader, guard=None):
    """``torch101_train_step.py``'s loop with ``train_step`` returning ``loss`` in place of ``loss.item()``."""
    step, backward = hooks(guard)
    loss_fn = nn.MSELoss(reduction='mean')

    def train_step(x, y):
        yhat = model(x)
        loss = loss_fn(y, yhat)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for epoch in range(2):
        for x_batch, y_batch in train_loader:
            with step():
                loss = train_step(x_batch, y_batch)
            losses.append(loss)
    return model, losses


def leak_messages(watch):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if watch:
            watched(leaky_closure_train, *linreg_build(), check="auto")
        else:
            leaky_closure_train(*linreg_build(), guard=GraphGuard(check="auto"))
    return [str(w.message) for w in caught if issubclass(w.category, GraphLeakWarning)]


def test_losses_a_step_closure_returns_kept_with_their_graphs_are_named():
    """``losses.append(train_step(x, y))`` with the loss tensor returned: the guard names ``losses``."""
    leaks = leak_messages(watch=False)
    assert any("`local losses[0]`" in text for text in leaks), leaks


def test_losses_a_step_closure_returns_kept_with_their_graphs_are_named_under_watch():
    """The same unmodified loop under ``watch``: the list in the loop's frame is to be named as with
    ``GraphGuard``."""
    leaks = leak_messages(watch=True)
    assert any("losses[0]" in text for text in leaks), leaks
