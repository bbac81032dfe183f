"""GradNorm, multi-task loss weights learned from gradient norms: brianlan/pytorch-grad-norm at commit
975ee855bde691cd5a102823e2575fcec6469a20, train.py (``train_toy_example`` with ``--mode grad_norm``),
model.py (``RegressionTrain``, ``RegressionModel``) and dataset.py (``RegressionDataset``).

The task weights are a ``Parameter`` of the model that Adam holds with the rest. Each step:

- the weighted sum of the task losses is back-propagated with ``retain_graph=True``;
- the weights' gradient is zeroed by replacing its data (``weights.grad.data = weights.grad.data * 0.0``);
- each task loss is differentiated again, through the retained graph, w.r.t. the last shared layer
  (``torch.autograd.grad(task_loss[i], W.parameters(), retain_graph=True)`` in a loop), the norms of the
  weighted gradients compared with a target made from the losses' ratios to the first step's (NumPy), and
  the weights' gradient assigned by hand (``weights.grad = torch.autograd.grad(grad_norm_loss, weights)[0]``);
- then Adam steps, and after each pass the weights are renormalized to sum to the number of tasks through
  ``.data`` (``model.weights.data = model.weights.data * normalize_coeff``).

The data set draws every sample's input from NumPy's global RNG each time it is read (targets from a fixed
random matrix), so each pass sees new inputs.

Changes for a seconds-long test: 16 inputs (250), hidden and output layers of 8 (100), 8 samples (100) in one
batch per pass as the source (batch 200 > 100), 6 passes (25000); the loader is the data set read in order
in the main process (``DataLoader(num_workers=4, shuffle=False)`` in the source); no CUDA; the records, prints
and plots are left out.

The port is manual: ``self.backward(loss, retain_graph=True)``, the zeroing, the norms and the assignment
as the source has them, ``self.step()``; the renormalization in ``on_step_end``, since every pass is one step
(the Trainer's ``on_epoch_end`` comes with the next pass's first batch, and not after the run's last).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules.loss import MSELoss

from safeloop import Trainer

from .harness import checks, compare

IN, HIDDEN, OUT, SAMPLES, PASSES = 16, 8, 8, 8, 6
args = type("args", (), dict(mode='grad_norm', alpha=0.12, sigma=100.0))


# -- model.py -----------------------------------------------------------------------------------------------
class RegressionTrain(torch.nn.Module):

    def __init__(self, model):
        # initialize the module using super() constructor
        super(RegressionTrain, self).__init__()
        # assign the architectures
        self.model = model
        # assign the weights for each task
        self.weights = torch.nn.Parameter(torch.ones(model.n_tasks).float())
        # loss function
        self.mse_loss = MSELoss()

    def forward(self, x, ts):
        B, n_tasks = ts.shape[:2]
        ys = self.model(x)

        # check if the number of tasks is equal to this size
        assert (ys.size()[1] == n_tasks)
        task_loss = []
        for i in range(n_tasks):
            task_loss.append(self.mse_loss(ys[:, i, :], ts[:, i, :]))
        task_loss = torch.stack(task_loss)

        return task_loss

    def get_last_shared_layer(self):
        return self.model.get_last_shared_layer()


class RegressionModel(torch.nn.Module):

    def __init__(self, n_tasks):
        # initialize the module using super() constructor
        super(RegressionModel, self).__init__()

        # number of tasks to solve
        self.n_tasks = n_tasks
        # fully connected layers
        self.l1 = torch.nn.Linear(IN, HIDDEN)  # (250, 100)
        self.l2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.l3 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.l4 = torch.nn.Linear(HIDDEN, HIDDEN)
        # branches for each task
        for i in range(self.n_tasks):
            setattr(self, 'task_{}'.format(i), torch.nn.Linear(HIDDEN, OUT))

    def forward(self, x):
        # forward pass through the common fully connected layers
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        h = F.relu(self.l3(h))
        h = F.relu(self.l4(h))

        # forward pass through each output layer
        outs = []
        for i in range(self.n_tasks):
            layer = getattr(self, 'task_{}'.format(i))
            outs.append(layer(h))

        return torch.stack(outs, dim=1)

    def get_last_shared_layer(self):
        return self.l4


# -- dataset.py ---------------------------------------------------------------------------------------------
class RegressionDataset(torch.utils.data.Dataset):

    def __init__(self, sigmas, epsilons):
        # B is a constant matrix with its elemenets generated IID
        # from a normal distribution N(0,10)
        self.B = np.random.normal(scale=10, size=(OUT, IN)).astype(np.float32)  # (100, 250)

        # check if the given epsilons have the appropriate size
        assert epsilons.shape == (len(sigmas), OUT, IN)

        # assign the epsilons and the sigmas
        self.sigmas = np.array(sigmas).astype(np.float32)
        self.epsilons = np.array(epsilons).astype(np.float32)

    def __len__(self):
        return SAMPLES  # 100

    def __getitem__(self, index):
        # retrieve a single input sample with d=250, normalized
        x = np.random.uniform(-1, 1, size=(IN,)).astype(np.float32)
        x = x / np.linalg.norm(x)

        # retrieve one target value for each of the tasks
        ys = []
        for i in range(len(self.sigmas)):
            # eq (3) on the paper:
            # each target is $\sigma_i \tanh((B + \epsilon_i)) \mathbf{x}) $
            ys.append(
                self.sigmas[i] * np.tanh((self.B + self.epsilons[i]).dot(x))
            )
        ys = np.stack(ys)

        # move everything to torch variables
        x = torch.from_numpy(x).float()
        ys = torch.from_numpy(ys).float()

        return x, ys


class Loader:
    """One batch of the whole data set per pass, read in order (each read draws new inputs)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        samples = [self.dataset[i] for i in range(len(self.dataset))]
        yield torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


def toy_data(model):
    """``train_toy_example``'s seeding, sigmas, epsilons and data set (NumPy's global RNG)."""
    np.random.seed(123)
    sigmas = [1.0, float(args.sigma)]
    n_tasks = len(sigmas)
    epsilons = np.random.normal(scale=3.5, size=(n_tasks, OUT, IN)).astype(np.float32)
    return Loader(RegressionDataset(sigmas, epsilons))


def toy_model():
    return RegressionTrain(RegressionModel(2))


# -- train.py -----------------------------------------------------------------------------------------------
def grad_norm_step(model, batch, t, state, backward, step):
    """The body of the source's inner loop, from the forward to ``optimizer.step()``."""
    X = batch[0]
    ts = batch[1]

    # evaluate each task loss L_i(t)
    task_loss = model(X, ts)  # this will do a forward pass in the model and will also evaluate the loss
    # compute the weighted loss w_i(t) * L_i(t)
    weighted_task_loss = torch.mul(model.weights, task_loss)
    # initialize the initial loss L(0) if t=0
    if t == 0:
        # set L(0)
        initial_task_loss = task_loss.data
        state["initial_task_loss"] = initial_task_loss.numpy()
    initial_task_loss = state["initial_task_loss"]

    # get the total loss
    loss = torch.sum(weighted_task_loss)
    # do the backward pass to compute the gradients for the whole set of weights
    backward(loss)

    # set the gradients of w_i(t) to zero because these gradients have to be updated using the GradNorm loss
    model.weights.grad.data = model.weights.grad.data * 0.0

    if args.mode == 'grad_norm':
        # get layer of shared weights
        W = model.get_last_shared_layer()

        # get the gradient norms for each of the tasks
        norms = []
        for i in range(len(task_loss)):
            # get the gradient of this task loss with respect to the shared parameters
            gygw = torch.autograd.grad(task_loss[i], W.parameters(), retain_graph=True)
            # compute the norm
            norms.append(torch.norm(torch.mul(model.weights[i], gygw[0])))
        norms = torch.stack(norms)

        # compute the inverse training rate r_i(t)
        loss_ratio = task_loss.data.numpy() / initial_task_loss
        # r_i(t)
        inverse_train_rate = loss_ratio / np.mean(loss_ratio)

        # compute the mean norm \tilde{G}_w(t)
        mean_norm = np.mean(norms.data.numpy())

        # compute the GradNorm loss
        # this term has to remain constant
        constant_term = torch.tensor(mean_norm * (inverse_train_rate ** args.alpha), requires_grad=False)
        # this is the GradNorm loss itself
        grad_norm_loss = torch.sum(torch.abs(norms - constant_term))

        # compute the gradient for the weights
        model.weights.grad = torch.autograd.grad(grad_norm_loss, model.weights)[0]

    # do a step with the optimizer
    step()
    return loss


def renormalize(model, n_tasks=2):
    normalize_coeff = n_tasks / torch.sum(model.weights.data, dim=0)
    model.weights.data = model.weights.data * normalize_coeff


def gradnorm_hand(model, data_loader):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = {}
    for t in range(PASSES):
        # get a single batch
        for (it, batch) in enumerate(data_loader):
            # clear the gradients
            optimizer.zero_grad()

            def backward(loss):
                loss.backward(retain_graph=True)
            grad_norm_step(model, batch, t, state, backward, optimizer.step)

        # renormalize
        renormalize(model)


class GradNorm(Trainer):
    automatic = False

    def configure_optimizers(self):
        self.grad_norm_state = {}
        return torch.optim.Adam(self.model.parameters(), lr=1e-4)

    def training_step(self, batch):
        return grad_norm_step(self.model, batch, self.state.epoch, self.grad_norm_state,
                              lambda loss: self.backward(loss, retain_graph=True), self.step)

    def on_step_end(self, losses):
        renormalize(self.model)


@pytest.mark.parametrize("check", checks())
def test_gradnorm_with_hand_assigned_task_weight_gradients(check):
    compare(toy_model, gradnorm_hand, GradNorm, toy_data, check, steps=PASSES)
