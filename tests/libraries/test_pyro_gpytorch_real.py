"""Two probabilistic libraries whose loops safeloop did not write, run from the same seeds bare, under
``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script), with a
``safeloop.GraphGuard`` in the loop, and ported to a ``safeloop.Trainer``:

- gpytorch 1.15 (its tutorials' loops: exact GP regression with ``ExactMarginalLogLikelihood``, the same on the
  Lanczos/CG path, deep kernel learning with a ``GridInterpolationKernel``, SVGP with ``VariationalELBO`` over
  mini-batches, natural gradient descent with two optimizers). Caches kept on the model (the prediction strategy,
  the variational strategy's ``_memoize_cache``, ``ScaleToBounds``' statistics) hold graphs from step to step and
  from an evaluation to the next step: no false alarm may come of them.
- pyro 1.9 (``svi.step`` running its own backward and its per-parameter ``pyro.optim`` optimizers, parameters made
  in the param store at the first step: svi_part_i's coin, svi_part_iii's ``TraceGraph_ELBO`` with a decaying
  average baseline, bayesian_regression's ``AutoDiagonalNormal``, examples/vae/vae.py; and the plain-torch patterns
  of custom_objectives' "lower-level pattern" and examples/svi_lightning.py).

Every parameter (pyro: the param store's values), the optimizers' state and what the loop records must come out bit
for bit the same in every guard mode, with no warning the bare run does not emit itself. Then the mistakes such loops
make (features of a neural network computed once before the loop, a VAE's encoder output computed once, a loss kept
with its graph for logging) must be stopped before the update they would corrupt, naming the tensor, and the fix the
message advises, written into the same loop, must run quiet and right.
"""
import contextlib
import math
import warnings

import pytest
import torch
import torch.nn as nn

gpytorch = pytest.importorskip("gpytorch")
pyro = pytest.importorskip("pyro")

import pyro.distributions as dist  # noqa: E402
import pyro.optim  # noqa: E402
from pyro.distributions import constraints  # noqa: E402
from pyro.distributions.testing.fakes import NonreparameterizedBeta  # noqa: E402
from pyro.infer import SVI, Trace_ELBO, TraceGraph_ELBO  # noqa: E402
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal  # noqa: E402
from pyro.nn import PyroModule, PyroSample  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import safeloop  # noqa: E402
from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import ConfigError, GraphLeakWarning, GraphReuseError  # noqa: E402
from safeloop.watch import Watch  # noqa: E402
from tests.libraries.compare import same  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402


@pytest.fixture(autouse=True)
def _pyro_state():
    """pyro's global state (the param store, ``module_local_params``) as a fresh process has it, before and after."""
    pyro.clear_param_store()
    local = pyro.settings.get("module_local_params")
    yield
    pyro.settings.set(module_local_params=local)
    pyro.clear_param_store()


# -- what every case runs -----------------------------------------------------------------------------------------


def three_ways(train, check, tmp_path=None):
    """``train()`` bare, under ``Watch`` (this file as the script) and ``train(guard=GraphGuard(check=check))``; each
    ``train`` seeds itself and returns a dict of what it trained and recorded, ``"start"`` the trained values before
    training. All of it is compared with the bare run's, bit for bit, the guarded runs warning nothing the bare run
    does not. Returns the bare run's result."""
    out = {"out_dir": tmp_path} if tmp_path is not None else {}
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = train()
    with strict(own), Watch(GraphGuard(check=check, **out), train.__code__.co_filename):
        same(train(), ref)
    with strict(own):
        same(train(guard=GraphGuard(check=check, **out)), ref)
    trained(ref)
    return ref


def trained(result) -> None:
    """Something moved: the comparison would prove nothing otherwise."""
    start, end = result["start"], result["params"]
    end = dict(end.named_parameters()) if isinstance(end, nn.Module) else end
    assert any(not torch.equal(start[k], end[k]) for k in start), "nothing trained"


def hooks(guard):
    """(step, backward) of a loop: the guard's, or a null context and ``Tensor.backward``."""
    if guard is None:
        return contextlib.nullcontext, torch.Tensor.backward
    return guard.step, guard.backward


def snapshot(module) -> dict:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def fit_quietly(trainer):
    """``trainer.fit()`` with warnings as errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit()
    return trainer


def trainer_kwargs(check):
    return dict(device="cpu", progress=False, loggers=(), guard={"check": check})


# == gpytorch: exact GP regression ==================================================================================
class ExactGPModel(gpytorch.models.ExactGP):
    """examples/01_Exact_GPs/Simple_GP_Regression.ipynb's model."""

    def __init__(self, train_x, train_y, likelihood):
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        mean_x = self.mean_module(x)
        covar_x = self.covar_module(x)
        return gpytorch.distributions.MultivariateNormal(mean_x, covar_x)


def exact_data(n=30):
    torch.manual_seed(0)
    train_x = torch.linspace(0, 1, n)
    train_y = torch.sin(train_x * (2 * math.pi)) + torch.randn(train_x.size()) * math.sqrt(0.04)
    return train_x, train_y


TEST_X = torch.linspace(0, 1, 11)


def predict(model, likelihood, test_x=TEST_X):
    """The tutorial's prediction: eval mode, ``torch.no_grad()`` and ``fast_pred_var()`` (the prediction strategy
    and LOVE's cache kept on the model); its mean and variance."""
    model.eval()
    likelihood.eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var():
        observed_pred = likelihood(model(test_x))
    return observed_pred.mean, observed_pred.variance


def exact_gp(guard=None, training_iter=6, evals=(), mistake=None):
    """Simple_GP_Regression's training loop (``evals``: the tutorial's prediction after those iterations, then
    training resumed in train mode; ``mistake="losses kept"``: its losses appended to a list with their graphs,
    ``"fixed"``: as ``.item()``)."""
    train_x, train_y = exact_data()
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(train_x, train_y, likelihood)
    start = snapshot(model)
    step, backward = hooks(guard)
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)  # Includes GaussianLikelihood parameters
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    preds, losses = [predict(model, likelihood)] if 0 in evals else [], []
    model.train()
    likelihood.train()
    for i in range(training_iter):
        with step():
            optimizer.zero_grad()
            output = model(train_x)
            loss = -mll(output, train_y)
            backward(loss)
            optimizer.step()
        losses.append(loss if mistake == "losses kept" else loss.item())
        if i + 1 in evals:
            preds.append(predict(model, likelihood))
            model.train()
            likelihood.train()
    return {"params": model, "start": start, "optimizer": optimizer.state_dict(), "preds": preds,
            "losses": [torch.as_tensor(v).item() for v in losses]}


@pytest.mark.parametrize("check", checks())
def test_exact_gp_regression(check):
    """Simple_GP_Regression.ipynb: ``loss = -mll(model(train_x), train_y); loss.backward(); optimizer.step()``, each
    step's covariance a lazy ``LinearOperator`` whose ``_memoize_cache`` holds its Cholesky factor with its graph."""
    three_ways(exact_gp, check)


@pytest.mark.parametrize("check", checks())
def test_exact_gp_predictions_between_training_steps(check):
    """The tutorial's prediction (``model.eval()``, ``no_grad``, ``fast_pred_var``: a prediction strategy and LOVE's
    cache stored on the model) before training and after iterations 2 and 4, training resumed after each."""
    ref = three_ways(lambda guard=None: exact_gp(guard, evals=(0, 2, 4)), check)
    assert len(ref["preds"]) == 3


@pytest.mark.parametrize("check", checks())
def test_exact_gp_on_the_lanczos_and_conjugate_gradients_path(check):
    """``max_cholesky_size(0)``: the marginal log likelihood by gpytorch's ``InvQuadLogdet`` autograd ``Function``
    (conjugate gradients, stochastic Lanczos quadrature with random probe vectors drawn at every step)."""
    def train(guard=None):
        with gpytorch.settings.max_cholesky_size(0), gpytorch.settings.num_trace_samples(5):
            return exact_gp(guard, training_iter=4, evals=(2,))
    three_ways(train, check)


class GPTrainer(safeloop.Trainer):
    """Simple_GP_Regression's loss as a ``training_step``; the tutorial's prediction as ``validation_step``."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=0.1)

    def on_fit_start(self):
        self.mll = gpytorch.mlls.ExactMarginalLogLikelihood(self.model.likelihood, self.model)
        self.preds = []

    def training_step(self, batch):
        train_x, train_y = batch
        return -self.mll(self.model(train_x), train_y)

    def validation_step(self, batch):
        (test_x,) = batch
        with gpytorch.settings.fast_pred_var():
            observed_pred = self.model.likelihood(self.model(test_x))
        self.preds.append((observed_pred.mean, observed_pred.variance))
        return observed_pred.mean.mean()


@pytest.mark.parametrize("check", checks())
def test_exact_gp_as_a_trainer_with_the_tutorials_prediction_as_validation(check):
    """``GPTrainer(model=ExactGPModel)`` over the full batch repeated, validating (eval mode, ``no_grad``, the modes
    put back by ``train(True)``, which clears gpytorch's caches) before training and every 2 steps: the same
    parameters, optimizer state and predictions as the tutorial's loop predicting at those points."""
    ref = exact_gp(evals=(0, 2, 4, 6))
    train_x, train_y = exact_data()
    model = ExactGPModel(train_x, train_y, gpytorch.likelihoods.GaussianLikelihood())
    model.train()
    trainer = fit_quietly(GPTrainer(model=model, train_data=[(train_x, train_y)] * 6, val_data=[(TEST_X,)],
                                    val_every=2, max_steps=6, **trainer_kwargs(check)))
    same(model, ref["params"])
    same(trainer.optimizers["optimizer"].state_dict(), ref["optimizer"])
    same(trainer.preds, ref["preds"])


# -- deep kernel learning: a network inside the GP ----------------------------------------------------------------
class LargeFeatureExtractor(nn.Sequential):
    """examples/06_PyTorch_NN_Integration_DKL/KISSGP_Deep_Kernel_Regression_CUDA.ipynb's, smaller."""

    def __init__(self, data_dim=4):
        super().__init__()
        self.add_module("linear1", nn.Linear(data_dim, 16))
        self.add_module("relu1", nn.ReLU())
        self.add_module("linear4", nn.Linear(16, 2))


class GPRegressionModel(gpytorch.models.ExactGP):
    """The DKL tutorial's model: features by the network in ``forward``, scaled by ``ScaleToBounds`` (which stores
    each batch's minimum and maximum through ``.data``), a ``GridInterpolationKernel`` (KISS-GP)."""

    def __init__(self, train_x, train_y, likelihood, feature_extractor):
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.GridInterpolationKernel(
            gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)), num_dims=2, grid_size=12)
        self.feature_extractor = feature_extractor
        self.scale_to_bounds = gpytorch.utils.grid.ScaleToBounds(-1., 1.)

    def forward(self, x):
        projected_x = self.feature_extractor(x)
        projected_x = self.scale_to_bounds(projected_x)
        mean_x = self.mean_module(projected_x)
        covar_x = self.covar_module(projected_x)
        return gpytorch.distributions.MultivariateNormal(mean_x, covar_x)


def dkl_data():
    torch.manual_seed(0)
    train_x = torch.rand(40, 4)
    return train_x, torch.sin(train_x.sum(-1) * 2) + 0.05 * torch.randn(40)


def dkl(guard=None, training_iterations=6):
    """The DKL tutorial's ``train()`` and its prediction (``use_toeplitz(False)``, ``fast_pred_var``) after 3
    iterations, training resumed."""
    train_x, train_y = dkl_data()
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = GPRegressionModel(train_x, train_y, likelihood, LargeFeatureExtractor())
    start = snapshot(model)
    step, backward = hooks(guard)
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam([{"params": model.feature_extractor.parameters()},
                                  {"params": model.covar_module.parameters()},
                                  {"params": model.mean_module.parameters()},
                                  {"params": model.likelihood.parameters()}], lr=0.01)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    preds = []
    for i in range(training_iterations):
        with step():
            optimizer.zero_grad()
            output = model(train_x)
            loss = -mll(output, train_y)
            backward(loss)
            optimizer.step()
        if i == 2:
            model.eval()
            likelihood.eval()
            with torch.no_grad(), gpytorch.settings.use_toeplitz(False), gpytorch.settings.fast_pred_var():
                pred = model(train_x[:7] + 0.01)
            preds.append((pred.mean, pred.variance))
            model.train()
            likelihood.train()
    return {"params": model, "start": start, "optimizer": optimizer.state_dict(), "preds": preds}


@pytest.mark.parametrize("check", checks())
def test_deep_kernel_learning_with_kiss_gp(check):
    """KISSGP_Deep_Kernel_Regression: the network's parameters and the GP's in one Adam, a prediction between
    iterations; torch's own warning about sparse invariant checks (the interpolation's sparse tensors) let through."""
    three_ways(dkl, check)


# == gpytorch: SVGP, mini-batches ===================================================================================
class SVGPModel(gpytorch.models.ApproximateGP):
    """examples/04_Variational_and_Approximate_GPs/SVGP_Regression_CUDA.ipynb's ``GPModel`` (``natural``: the
    Natural_Gradient_Descent notebook's, with a ``NaturalVariationalDistribution``)."""

    def __init__(self, inducing_points, natural=False):
        variational_distribution = (gpytorch.variational.NaturalVariationalDistribution if natural else
                                    gpytorch.variational.CholeskyVariationalDistribution)(inducing_points.size(0))
        variational_strategy = gpytorch.variational.VariationalStrategy(
            self, inducing_points, variational_distribution, learn_inducing_locations=True)
        super().__init__(variational_strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        mean_x = self.mean_module(x)
        covar_x = self.covar_module(x)
        return gpytorch.distributions.MultivariateNormal(mean_x, covar_x)


SVGP_TEST_X = torch.linspace(0, 1, 11)[:, None].expand(11, 2)


def svgp_build(natural=False):
    """The data, the model (its inducing points the first training inputs, as the tutorial takes them) and its
    likelihood; then torch's generator seeded for the training (shuffling, the variational distribution's
    initialization at the model's first call)."""
    torch.manual_seed(0)
    train_x = torch.rand(64, 2)
    train_y = torch.sin(train_x[:, 0] * 6) + 0.1 * torch.randn(64)
    model = SVGPModel(train_x[:10, :].clone(), natural=natural)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    torch.manual_seed(1)
    return model, likelihood, train_x, train_y


def svgp_predict(model, likelihood, preds):
    """The tutorial's prediction (eval mode, ``no_grad``) inside ``torch.random.fork_rng()``: what a Trainer's
    validation does to the random generators (training draws what it would have drawn without the pass)."""
    model.eval()
    likelihood.eval()
    with torch.no_grad(), torch.random.fork_rng():
        pred = likelihood(model(SVGP_TEST_X))
    preds.append((pred.mean, pred.variance))
    model.train()
    likelihood.train()


def svgp(guard=None, num_epochs=2, evals=()):
    """SVGP_Regression_CUDA's loop over a shuffled ``DataLoader`` (``evals``: predictions before training (0) and
    after those iterations)."""
    model, likelihood, train_x, train_y = svgp_build()
    step, backward = hooks(guard)
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=16, shuffle=True)
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam([{"params": model.parameters()}, {"params": likelihood.parameters()}], lr=0.01)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=train_y.size(0))
    start = snapshot(mll)
    preds, done = [], 0
    if 0 in evals:
        svgp_predict(model, likelihood, preds)
    for i in range(num_epochs):
        for x_batch, y_batch in train_loader:
            with step():
                optimizer.zero_grad()
                output = model(x_batch)
                loss = -mll(output, y_batch)
                backward(loss)
                optimizer.step()
            done += 1
            if done in evals:
                svgp_predict(model, likelihood, preds)
    return {"params": mll, "start": start, "optimizer": optimizer.state_dict(), "preds": preds}


@pytest.mark.parametrize("check", checks())
def test_svgp_minibatches(check):
    """SVGP_Regression_CUDA: ``VariationalELBO`` over shuffled mini-batches; the variational strategy keeps its
    memoized prior, Cholesky factor and variational distribution (with their graphs) until its next call clears
    them, and predictions after iterations 3 and 5 leave their eval-mode caches on it."""
    ref = three_ways(lambda guard=None: svgp(guard, evals=(3, 5)), check)
    assert len(ref["preds"]) == 2


class SVGPTrainer(safeloop.Trainer):
    """``model`` the ``VariationalELBO`` (a module holding the GP and its likelihood), as the tutorial's loss."""

    def configure_optimizers(self):
        return torch.optim.Adam([{"params": self.model.model.parameters()},
                                 {"params": self.model.likelihood.parameters()}], lr=0.01)

    def on_fit_start(self):
        self.preds = []

    def training_step(self, batch):
        x_batch, y_batch = batch
        return -self.model(self.model.model(x_batch), y_batch)

    def validation_step(self, batch):
        pred = self.model.likelihood(self.model.model(batch[0]))
        self.preds.append((pred.mean, pred.variance))
        return pred.mean.mean()


@pytest.mark.parametrize("check", checks())
def test_svgp_as_a_trainer_validating_before_training_and_every_4_steps(check):
    """``SVGPTrainer(model=mll)``: the first call of the model, the validation before training, initializes the
    variational distribution with ``torch.randn``; the Trainer then puts the generators back, so the epoch's shuffle
    draws what it would have drawn without the pass. That is the tutorial's loop with its predictions in
    ``fork_rng()``, the first one before the loader's first iterator, bit for bit."""
    ref = svgp(evals=(0, 4, 8))
    model, likelihood, train_x, train_y = svgp_build()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=train_y.size(0))
    mll.train()
    trainer = fit_quietly(SVGPTrainer(
        model=mll, train_data=DataLoader(TensorDataset(train_x, train_y), batch_size=16, shuffle=True),
        val_data=[(SVGP_TEST_X,)], val_every=4, max_steps=8, **trainer_kwargs(check)))
    same(mll, ref["params"])
    same(trainer.optimizers["optimizer"].state_dict(), ref["optimizer"])
    same(trainer.preds, ref["preds"])


def ngd(guard=None, num_epochs=2):
    """Natural_Gradient_Descent.ipynb's loop: ``gpytorch.optim.NGD`` over the variational parameters and Adam over
    the hyperparameters, both zeroed and stepped after one backward."""
    model, likelihood, train_x, train_y = svgp_build(natural=True)
    step, backward = hooks(guard)
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=16, shuffle=True)
    model.train()
    likelihood.train()
    variational_ngd_optimizer, hyperparameter_optimizer = ngd_optimizers(model, likelihood, train_y.size(0))
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=train_y.size(0))
    start = snapshot(mll)
    for i in range(num_epochs):
        for x_batch, y_batch in train_loader:
            with step():
                variational_ngd_optimizer.zero_grad()
                hyperparameter_optimizer.zero_grad()
                output = model(x_batch)
                loss = -mll(output, y_batch)
                backward(loss)
                variational_ngd_optimizer.step()
                hyperparameter_optimizer.step()
    return {"params": mll, "start": start, "optimizer": hyperparameter_optimizer.state_dict()}


def ngd_optimizers(model, likelihood, num_data):
    return (gpytorch.optim.NGD(model.variational_parameters(), num_data=num_data, lr=0.1),
            torch.optim.Adam([{"params": model.hyperparameters()}, {"params": likelihood.parameters()}], lr=0.01))


@pytest.mark.parametrize("check", checks())
def test_svgp_natural_gradient_descent_two_optimizers(check):
    """Natural_Gradient_Descent: two optimizers stepping after one backward (under watch a step ends at each)."""
    three_ways(ngd, check)


class NGDTrainer(safeloop.Trainer):
    """The two optimizers by name, the one loss under both names: each routed to its optimizer's parameters."""

    def configure_optimizers(self):
        variational, hyper = ngd_optimizers(self.model.model, self.model.likelihood, self.model.num_data)
        return {"ngd": variational, "hyper": hyper}

    def training_step(self, batch):
        x_batch, y_batch = batch
        loss = -self.model(self.model.model(x_batch), y_batch)
        return {"ngd": loss, "hyper": loss}


@pytest.mark.parametrize("check", checks())
def test_svgp_natural_gradient_descent_as_a_trainer(check):
    """``{"ngd": loss, "hyper": loss}`` with ``{"ngd": NGD, "hyper": Adam}``: each backward routed by
    ``inputs=`` to its optimizer's parameters gives each the gradient the loop's one backward gives it."""
    ref = ngd()
    model, likelihood, train_x, train_y = svgp_build(natural=True)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=train_y.size(0))
    mll.train()
    trainer = fit_quietly(NGDTrainer(
        model=mll, train_data=DataLoader(TensorDataset(train_x, train_y), batch_size=16, shuffle=True),
        max_steps=8, **trainer_kwargs(check)))
    same(mll, ref["params"])
    same(trainer.optimizers["hyper"].state_dict(), ref["optimizer"])


# == pyro: SVI, its own backward and optimizers =====================================================================
def store() -> dict:
    """The param store's (constrained) values."""
    return {name: value.detach().clone() for name, value in pyro.get_param_store().items()}


def pyro_result(optimizer, start, **recorded):
    """What an SVI run leaves: the param store, each per-parameter torch optimizer's state (``PyroOptim.get_state``,
    keyed by parameter name) and what the loop recorded."""
    return {"params": store(), "start": start, "optimizer": optimizer.get_state(), **recorded}


def coin_data():
    """svi_part_i: six heads and four tails."""
    return [torch.tensor(1.0)] * 6 + [torch.tensor(0.0)] * 4


def coin_model(data):
    """svi_part_i's ``model``."""
    alpha0 = torch.tensor(10.0)
    beta0 = torch.tensor(10.0)
    f = pyro.sample("latent_fairness", dist.Beta(alpha0, beta0))
    for i in range(len(data)):
        pyro.sample("obs_{}".format(i), dist.Bernoulli(f), obs=data[i])


def coin_guide(data):
    """svi_part_i's ``guide``: its two parameters made in the param store at the first step."""
    alpha_q = pyro.param("alpha_q", torch.tensor(15.0), constraint=constraints.positive)
    beta_q = pyro.param("beta_q", torch.tensor(15.0), constraint=constraints.positive)
    pyro.sample("latent_fairness", dist.Beta(alpha_q, beta_q))


def coin(guard=None, n_steps=20):
    """svi_part_i's loop, ``svi.step(data)``, ``with guard.step()`` around each step when guarded."""
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    data = coin_data()
    adam_params = {"lr": 0.005, "betas": (0.90, 0.999)}
    optimizer = pyro.optim.Adam(adam_params)
    svi = SVI(coin_model, coin_guide, optimizer, loss=Trace_ELBO())
    step = guard.step if guard is not None else contextlib.nullcontext
    losses = []
    for _ in range(n_steps):
        with step():
            losses.append(svi.step(data))
    return pyro_result(optimizer, {"alpha_q": torch.tensor(15.0), "beta_q": torch.tensor(15.0)}, losses=losses)


@pytest.mark.parametrize("check", checks())
def test_svi_coin_fairness(check):
    """svi_part_i.ipynb: ``svi.step`` back-propagates Trace_ELBO's surrogate loss itself, makes a ``torch.optim.Adam``
    per parameter as it first meets it, steps each and sets gradients to zeros (not None)."""
    ref = three_ways(coin, check)
    assert set(ref["params"]) == {"alpha_q", "beta_q"}


class BernoulliBetaExample:
    """svi_part_iii.ipynb's example: a non-reparameterized Beta, ``TraceGraph_ELBO`` with a decaying average baseline
    (kept in the param store under ``torch.no_grad()``, replaced every step)."""

    def __init__(self, max_steps):
        self.max_steps = max_steps
        self.alpha0 = 10.0
        self.beta0 = 10.0
        self.data = torch.zeros(10)
        self.data[0:6] = torch.ones(6)
        self.n_data = self.data.size(0)
        self.alpha_n = self.data.sum() + self.alpha0
        self.beta_n = - self.data.sum() + torch.tensor(self.beta0 + self.n_data)
        self.alpha_q_0 = 15.0
        self.beta_q_0 = 15.0

    def model(self, use_decaying_avg_baseline):
        f = pyro.sample("latent_fairness", dist.Beta(self.alpha0, self.beta0))
        with pyro.plate("data_plate"):
            pyro.sample("obs", dist.Bernoulli(f), obs=self.data)

    def guide(self, use_decaying_avg_baseline):
        alpha_q = pyro.param("alpha_q", torch.tensor(self.alpha_q_0), constraint=constraints.positive)
        beta_q = pyro.param("beta_q", torch.tensor(self.beta_q_0), constraint=constraints.positive)
        baseline_dict = {"use_decaying_avg_baseline": use_decaying_avg_baseline, "baseline_beta": 0.90}
        pyro.sample("latent_fairness", NonreparameterizedBeta(alpha_q, beta_q), infer=dict(baseline=baseline_dict))

    def do_inference(self, use_decaying_avg_baseline, tolerance=0.80, step=contextlib.nullcontext):
        pyro.clear_param_store()
        optimizer = pyro.optim.Adam({"lr": .0005, "betas": (0.93, 0.999)})
        svi = SVI(self.model, self.guide, optimizer, loss=TraceGraph_ELBO())
        errors = []
        for k in range(self.max_steps):
            with step():
                svi.step(use_decaying_avg_baseline)
            # (the tutorial's param_abs_error: pyro.param between steps, a graph made and dropped)
            alpha_error = torch.sum(torch.abs(self.alpha_n - pyro.param("alpha_q"))).item()
            beta_error = torch.sum(torch.abs(self.beta_n - pyro.param("beta_q"))).item()
            errors.append((alpha_error, beta_error))
            if alpha_error < tolerance and beta_error < tolerance:
                break
        return optimizer, errors


def bernoulli_beta(guard=None):
    pyro.set_rng_seed(0)
    optimizer, errors = BernoulliBetaExample(max_steps=15).do_inference(
        use_decaying_avg_baseline=True, step=guard.step if guard is not None else contextlib.nullcontext)
    return pyro_result(optimizer, {"alpha_q": torch.tensor(15.0), "beta_q": torch.tensor(15.0)}, errors=errors)


@pytest.mark.parametrize("check", checks())
def test_svi_tracegraph_elbo_with_a_decaying_average_baseline(check):
    """svi_part_iii.ipynb's ``do_inference(use_decaying_avg_baseline=True)``: a score-function estimator; the
    baseline a new param-store tensor each step, for which pyro makes a new per-parameter optimizer each step."""
    ref = three_ways(bernoulli_beta, check)
    assert "__baseline_avg_downstream_cost_latent_fairness" in ref["params"]


class BayesianRegression(PyroModule):
    """bayesian_regression.ipynb's model: ``PyroSample`` priors on a ``PyroModule[nn.Linear]``."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = PyroModule[nn.Linear](in_features, out_features)
        self.linear.weight = PyroSample(dist.Normal(0., 1.).expand([out_features, in_features]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0., 10.).expand([out_features]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Uniform(0., 10.))
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


def bayesian_regression(guard=None, num_iterations=15):
    """bayesian_regression's SVI loop with ``AutoDiagonalNormal`` (its ``loc`` and ``scale`` made at the first step),
    then ``Predictive``."""
    pyro.set_rng_seed(1)
    gen = torch.Generator().manual_seed(2)
    x_data = torch.randn(40, 3, generator=gen)
    y_data = x_data.sum(-1) + 0.1 * torch.randn(40, generator=gen)
    model = BayesianRegression(3, 1)
    guide = AutoDiagonalNormal(model)
    adam = pyro.optim.Adam({"lr": 0.03})
    svi = SVI(model, guide, adam, loss=Trace_ELBO())
    pyro.clear_param_store()
    step = guard.step if guard is not None else contextlib.nullcontext
    losses, start = [], None
    for _ in range(num_iterations):
        with step():
            losses.append(svi.step(x_data, y_data))
        start = store() if start is None else start  # (made by the first step: as it left them)
    predictive = pyro.infer.Predictive(model, guide=guide, num_samples=5, return_sites=("linear.weight", "obs"))
    samples = predictive(x_data)
    return pyro_result(adam, start, losses=losses, samples=samples)


@pytest.mark.parametrize("check", checks())
def test_svi_bayesian_regression_with_an_autoguide_and_predictive(check):
    """bayesian_regression.ipynb: the autoguide's parameters appear at the first ``svi.step``; ``Predictive`` after
    training draws the same samples."""
    three_ways(bayesian_regression, check)


# -- examples/vae/vae.py ------------------------------------------------------------------------------------------
PIXELS = 16


class Encoder(nn.Module):
    """vae.py's ``Encoder``, on 16 pixels."""

    def __init__(self, z_dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(PIXELS, hidden_dim)
        self.fc21 = nn.Linear(hidden_dim, z_dim)
        self.fc22 = nn.Linear(hidden_dim, z_dim)
        self.softplus = nn.Softplus()

    def forward(self, x):
        x = x.reshape(-1, PIXELS)
        hidden = self.softplus(self.fc1(x))
        z_loc = self.fc21(hidden)
        z_scale = torch.exp(self.fc22(hidden))
        return z_loc, z_scale


class Decoder(nn.Module):
    def __init__(self, z_dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(z_dim, hidden_dim)
        self.fc21 = nn.Linear(hidden_dim, PIXELS)
        self.softplus = nn.Softplus()

    def forward(self, z):
        hidden = self.softplus(self.fc1(z))
        return torch.sigmoid(self.fc21(hidden))


class VAE(nn.Module):
    """vae.py's ``VAE``: ``pyro.module`` registers the encoder's and decoder's parameters in the param store.
    ``encoded``: the guide reads the encoder's output from there instead of calling the encoder (a mistake below)."""

    def __init__(self, z_dim=3, hidden_dim=8):
        super().__init__()
        self.encoder = Encoder(z_dim, hidden_dim)
        self.decoder = Decoder(z_dim, hidden_dim)
        self.z_dim = z_dim
        self.encoded = None

    def model(self, x):
        pyro.module("decoder", self.decoder)
        with pyro.plate("data", x.shape[0]):
            z_loc = torch.zeros(x.shape[0], self.z_dim, dtype=x.dtype, device=x.device)
            z_scale = torch.ones(x.shape[0], self.z_dim, dtype=x.dtype, device=x.device)
            z = pyro.sample("latent", dist.Normal(z_loc, z_scale).to_event(1))
            loc_img = self.decoder.forward(z)
            pyro.sample("obs", dist.Bernoulli(loc_img, validate_args=False).to_event(1),
                        obs=x.reshape(-1, PIXELS))
            return loc_img

    def guide(self, x):
        pyro.module("encoder", self.encoder)
        with pyro.plate("data", x.shape[0]):
            z_loc, z_scale = self.encoder.forward(x) if self.encoded is None else self.encoded
            pyro.sample("latent", dist.Normal(z_loc, z_scale).to_event(1))


def images(n=4, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [((torch.rand(8, PIXELS, generator=gen) > 0.5).float(), None) for _ in range(n)]


def vae_main(guard=None, num_epochs=2, mistake=None, checked_loss=False):
    """vae.py's ``main``: ``epoch_loss += svi.step(x)`` over the training batches, ``svi.evaluate_loss`` over the
    test batches after each epoch. ``mistake="encoded once"``: the encoder's output for the (one) training batch
    computed once before the loop, with its graph, for the guide to read. ``checked_loss``: SVI given a loss callable
    that runs ``guard.check`` (SVI then back-propagates it with ``retain_graph=True``)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    train_loader, test_loader = images(1 if mistake else 4), images(2, seed=4)
    vae = VAE()
    start = snapshot(vae)
    optimizer = pyro.optim.Adam({"lr": 0.01})
    if checked_loss:
        def elbo(model, guide, *args):
            loss = Trace_ELBO().differentiable_loss(model, guide, *args)
            if torch.is_grad_enabled():  # (svi.evaluate_loss calls it too, under no_grad: no backward follows)
                guard.check(loss)
            return loss
    else:
        elbo = Trace_ELBO()
    svi = SVI(vae.model, vae.guide, optimizer, loss=elbo)
    if mistake == "encoded once":
        encoded = vae.encoder(train_loader[0][0])
        vae.encoded = encoded
    step = guard.step if guard is not None else contextlib.nullcontext
    train_elbo, test_elbo = {}, {}
    for epoch in range(num_epochs):
        epoch_loss = 0.0
        for x, _ in train_loader:
            with step():
                epoch_loss += svi.step(x)
        train_elbo[epoch] = epoch_loss
        test_loss = 0.0
        for x, _ in test_loader:
            test_loss += svi.evaluate_loss(x)
        test_elbo[epoch] = test_loss
    return {"params": vae, "start": start, "store": store(), "optimizer": optimizer.get_state(),
            "train_elbo": train_elbo, "test_elbo": test_elbo}


@pytest.mark.parametrize("check", checks())
def test_svi_vae_example(check):
    """examples/vae/vae.py: ``pyro.module`` networks, one pyro-made Adam per tensor of the encoder and decoder, and
    ``svi.evaluate_loss`` (no backward) between epochs."""
    ref = three_ways(vae_main, check)
    assert len(ref["optimizer"]) == 10


def test_vae_encoder_output_computed_once_fails_the_second_step_bare():
    """Bare, the encoder output computed before the loop fails in PyTorch's backward of the second ``svi.step``,
    after the first updated the encoder with its gradient."""
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        vae_main(mistake="encoded once")


def test_vae_encoder_output_computed_once_is_named_under_watch(tmp_path):
    """Under watch, the backward ``Trace_ELBO`` runs inside ``svi.step`` is checked: stopped at step 1, naming the
    tensor and advising to recompute it inside the loop (the example's own guide). The loop's own variables hold no
    graph (``svi.step`` returns a float): the pair is known to be older than the loop because a tuple held by a
    variable the loop does not assign cannot change (before that fix: a ``CarriedGraphError`` at step 2 advising to
    detach it at the end of each step, which would have frozen the encoder's output after the first update)."""
    with Watch(GraphGuard(out_dir=tmp_path), __file__), pytest.raises(
            GraphReuseError, match=r"\(step 1, .*built before the step \(before the loop\) and held by "
                                   r"`vae.encoded\[1\]`.*To fix: recompute `vae.encoded\[1\]` inside the loop"):
        vae_main(mistake="encoded once")


def test_graph_guard_around_svi_step_sees_no_backward_of_pyros(tmp_path):
    """``with guard.step(): svi.step(x)`` marks the steps, but ``Trace_ELBO`` calls backward itself: the guard is
    never shown the loss, and the mistake reaches PyTorch's own error at the second step."""
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as caught:
        vae_main(GraphGuard(out_dir=tmp_path), mistake="encoded once")
    assert not isinstance(caught.value, safeloop.GraphLifecycleError)


def test_graph_guard_check_in_an_svi_loss_callable_names_the_encoder_output(tmp_path):
    """``SVI(..., loss=callable)`` (pyro's custom-loss route) whose callable runs ``guard.check`` on
    ``Trace_ELBO().differentiable_loss``: stopped at step 1 before pyro's backward, naming the tensor."""
    with pytest.raises(GraphReuseError, match=r"\(step 1, .*held by `vae.encoded\[1\]`.*To fix: recompute "
                                              r"`vae.encoded\[1\]` inside the loop"):
        vae_main(GraphGuard(out_dir=tmp_path), mistake="encoded once", checked_loss=True)


@pytest.mark.parametrize("check", checks())
def test_svi_loss_callable_with_guard_check_trains_as_without_the_guard(check):
    """The custom-loss route with ``guard.check`` on the example's VAE: bit for bit the same callable without a
    guard (``Watch`` left out: there the callable's ``guard`` is None)."""
    ref = vae_main(checked_loss=True, guard=GraphGuard(check="off"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same(vae_main(GraphGuard(check=check), checked_loss=True), ref)
    trained(ref)


def test_graph_guard_refuses_pyros_optimizer_with_a_clear_message():
    """``GraphGuard(model, optimizers=pyro.optim.Adam(...))``: a ``PyroOptim`` is no torch optimizer (it makes one
    per parameter as ``svi.step`` meets them), so a step cannot end at its step: refused at once."""
    with pytest.raises(ConfigError, match=r"optimizers=.* is of type PyroOptim: give a torch.optim.Optimizer"):
        GraphGuard(VAE(), pyro.optim.Adam({"lr": 0.01}))


# -- custom_objectives' lower-level pattern, examples/svi_lightning.py: a torch optimizer -------------------------
def lower_level(guard=None, n_iter=20, mistake=None):
    """custom_objectives.ipynb's "lower-level pattern" on svi_part_i's coin: one ``differentiable_loss`` call before
    the loop to make the parameters, then ``loss.backward(); optimizer.step(); optimizer.zero_grad()``.
    ``mistake="epoch_loss += loss"``: vae.py's ``epoch_loss += svi.step(x)`` ported as is (``"fixed"``: ``+=
    loss.item()``)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    data = coin_data()
    loss_fn = lambda model, guide: Trace_ELBO().differentiable_loss(model, guide, data)  # noqa: E731
    with pyro.poutine.trace(param_only=True) as param_capture:
        loss = loss_fn(coin_model, coin_guide)
    params = set(site["value"].unconstrained() for site in param_capture.trace.nodes.values())
    optimizer = torch.optim.Adam(params, lr=0.01, betas=(0.90, 0.999))
    start = store()
    step, backward = hooks(guard)
    epoch_loss = 0.0
    for i in range(n_iter):
        with step():
            loss = loss_fn(coin_model, coin_guide)
            backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        epoch_loss += loss if mistake == "epoch_loss += loss" else loss.item()
    return lower_level_result(optimizer, start, epoch_loss=torch.as_tensor(epoch_loss).item())


def lower_level_result(optimizer, start, **recorded):
    """The param store, and the optimizer's state by parameter name (its parameters a set: their order varies)."""
    names = pyro.get_param_store()
    return {"params": store(), "start": start, **recorded,
            "optimizer": {names.param_name(p): state for p, state in optimizer.state.items()}}


@pytest.mark.parametrize("check", checks())
def test_lower_level_pattern_with_a_torch_optimizer(check):
    """custom_objectives.ipynb's lower-level pattern: the loss before the loop (with its graph) is replaced by the
    loop's first ``loss =``; no false alarm."""
    three_ways(lower_level, check)


class LowerLevelTrainer(safeloop.Trainer):
    """The lower-level pattern's loss as ``training_step``; the optimizer made from the parameters the first call
    made, before the Trainer; no ``model``: the parameters live in pyro's param store."""

    def __init__(self, *, made, **kwargs):
        self.made = made
        super().__init__(**kwargs)

    def configure_optimizers(self):
        return self.made

    def training_step(self, batch):
        return Trace_ELBO().differentiable_loss(coin_model, coin_guide, batch)


@pytest.mark.parametrize("check", checks())
def test_lower_level_pattern_as_a_trainer_without_a_model(check):
    """``LowerLevelTrainer(model=None, train_data=[data] * 20)`` after the pattern's first call: the loop's param
    store and optimizer state, bit for bit."""
    ref = lower_level()
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    data = coin_data()
    with pyro.poutine.trace(param_only=True) as param_capture:
        Trace_ELBO().differentiable_loss(coin_model, coin_guide, data)
    params = set(site["value"].unconstrained() for site in param_capture.trace.nodes.values())
    optimizer = torch.optim.Adam(params, lr=0.01, betas=(0.90, 0.999))
    fit_quietly(LowerLevelTrainer(made=optimizer, train_data=[data] * 20, max_steps=20, **trainer_kwargs(check)))
    got = lower_level_result(optimizer, None)
    same(got["params"], ref["params"])
    same(got["optimizer"], ref["optimizer"])


def test_lower_level_pattern_with_its_losses_summed_with_their_graphs_is_named(tmp_path):
    """``epoch_loss += loss``: under watch and with a ``GraphGuard``, a ``GraphLeakWarning`` naming ``epoch_loss``
    with the fix; the bare run says nothing."""
    for run in (lambda: watched_run(lower_level, tmp_path, mistake="epoch_loss += loss"),
                lambda: lower_level(GraphGuard(out_dir=tmp_path), mistake="epoch_loss += loss")):
        with pytest.warns(GraphLeakWarning, match=r"held by `local epoch_loss`.*Store loss.item\(\) or "
                                                  r"loss.detach\(\) instead"):
            run()


def watched_run(train, tmp_path, **kwargs):
    with Watch(GraphGuard(out_dir=tmp_path), train.__code__.co_filename):
        return train(**kwargs)


class Model(PyroModule):
    """examples/svi_lightning.py's ``Model``."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def forward(self, covariates, data=None):
        coeff = pyro.sample("coeff", dist.Normal(0, 1))
        bias = pyro.sample("bias", dist.Normal(0, 1))
        scale = pyro.sample("scale", dist.LogNormal(0, 1))
        with pyro.plate("data", self.size, len(covariates)):
            loc = bias + coeff * covariates
            return pyro.sample("obs", dist.Normal(loc, scale), obs=data)


def lightning_build(size=64, batch_size=16):
    """svi_lightning.py's ``main`` up to the fit: ``module_local_params``, data drawn from the model, ``AutoNormal``,
    ``loss_fn = Trace_ELBO()(model, guide)`` (an ``ELBOModule``) run on one mini-batch to make the parameters."""
    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    pyro.settings.set(module_local_params=True)
    model = Model(size)
    covariates = torch.randn(size)
    data = model(covariates)
    guide = AutoNormal(model)
    loss_fn = Trace_ELBO()(model, guide)
    dataset = TensorDataset(covariates, data)
    loss_fn(*dataset[:batch_size])
    pyro.set_rng_seed(1)
    return loss_fn, DataLoader(dataset, batch_size=batch_size)


def lightning_loop(guard=None, epochs=2):
    """What Lightning runs for svi_lightning.py's ``PyroLightningModule``: zero_grad, ``loss_fn(*batch)``, backward,
    Adam's step."""
    loss_fn, dataloader = lightning_build()
    start = snapshot(loss_fn)
    optimizer = torch.optim.Adam(loss_fn.parameters(), lr=0.01)
    step, backward = hooks(guard)
    for epoch in range(epochs):
        for batch in dataloader:
            with step():
                optimizer.zero_grad()
                loss = loss_fn(*batch)
                backward(loss)
                optimizer.step()
    return {"params": loss_fn, "start": start, "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("check", checks())
def test_svi_lightning_loop(check):
    """examples/svi_lightning.py's training plan as a plain loop: an ``ELBOModule`` and a torch Adam."""
    three_ways(lightning_loop, check)


class PyroTrainer(safeloop.Trainer):
    """svi_lightning.py's ``PyroLightningModule`` as a safeloop Trainer: ``model`` the ``ELBOModule``."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=0.01)

    def training_step(self, batch):
        loss = self.model(*batch)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("check", checks())
def test_svi_lightning_as_a_trainer(check):
    """``PyroTrainer(model=loss_fn, train_data=dataloader, max_epochs=2)``: the loop's parameters and Adam state."""
    ref = lightning_loop()
    loss_fn, dataloader = lightning_build()
    trainer = fit_quietly(PyroTrainer(model=loss_fn, train_data=dataloader, max_epochs=2, **trainer_kwargs(check)))
    same(loss_fn, ref["params"])
    same(trainer.optimizers["optimizer"].state_dict(), ref["optimizer"])


# == mistakes in a gpytorch loop ====================================================================================
def features_once(guard=None, iters=4, fix=None):
    """Simple_GP_Regression's loop on features a network computes, as deep kernel learning does, but computed once
    before the loop with their graph (``fix="detach"`` / ``"no_grad"``: the error's constant fixes)."""
    torch.manual_seed(0)
    raw_x = torch.rand(20, 3)
    train_y = torch.sin(raw_x.sum(-1) * 3)
    feature_extractor = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with torch.no_grad() if fix == "no_grad" else contextlib.nullcontext():
        features = feature_extractor(raw_x).squeeze(-1)
    if fix == "detach":
        features = features.detach()
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(features, train_y, likelihood)
    start = snapshot(model)
    step, backward = hooks(guard)
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    for i in range(iters):
        with step():
            optimizer.zero_grad()
            output = model(features)
            loss = -mll(output, train_y)
            backward(loss)
            optimizer.step()
    return {"params": model, "start": start, "optimizer": optimizer.state_dict()}


def test_gp_features_computed_once_with_their_graph_fail_bare():
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        features_once()


@pytest.mark.parametrize("how", ["watch", "graph guard"])
def test_gp_features_computed_once_with_their_graph_are_named(how, tmp_path):
    """Stopped at step 1 (bare: PyTorch's error at step 2), naming ``features`` and the network's weights it would
    stop the gradient of: no optimizer holds them, so keeping it a constant comes first."""
    with pytest.raises(GraphReuseError, match=r"\(step 1, .*held by `local features`.*To fix: if it is meant as a "
                                              r"constant .*`feature_extractor.2.weight`.*store `features.detach\(\)` "
                                              r"instead, or compute it under `torch.no_grad\(\)`; or recompute "
                                              r"`features` inside the loop"):
        if how == "watch":
            watched_run(features_once, tmp_path)
        else:
            features_once(GraphGuard(out_dir=tmp_path))


@pytest.mark.parametrize("check", checks())
def test_gp_features_detached_as_the_error_advises(check):
    """``features.detach()`` (a fixed network, as meant): quiet in every mode, and the same GP as features computed
    under ``torch.no_grad()``, the other fix."""
    ref = three_ways(lambda guard=None: features_once(guard, fix="detach"), check)
    same(features_once(fix="no_grad"), ref)


def test_gp_losses_kept_with_their_graphs_are_named(tmp_path):
    """Simple_GP_Regression's losses appended to a list with their graphs (meant: ``loss.item()``): a
    ``GraphLeakWarning`` naming the list, under watch and with a ``GraphGuard``."""
    for run in (lambda: watched_run(exact_gp, tmp_path, mistake="losses kept"),
                lambda: exact_gp(GraphGuard(out_dir=tmp_path), mistake="losses kept")):
        with pytest.warns(GraphLeakWarning, match=r"held by `local losses\[0\]`.*To fix: detach what is added to "
                                                  r"`losses` where it is added"):
            run()
