"""Self-supervised learning without negative pairs: BYOL, from lucidrains/byol-pytorch,
byol_pytorch/byol_pytorch.py (BYOL, NetWrapper, EMA, as of commit 2993126, simplicial embeddings on by
default) and README.md (its training loop: ``opt = Adam(learner.parameters())`` after ``BYOL(...)``,
``learner.update_moving_average()`` after each ``opt.step()``).

The representation is caught by a forward hook on a hidden layer of the wrapped net. The projector is
made lazily by the first forward (the ``singleton`` decorator), and so is the target encoder: a
deepcopy of the online encoder with ``requires_grad`` off, run under ``no_grad``. The constructor sends
a mock batch through ``forward`` so that both exist before the optimizer is built: the optimizer holds
the target's frozen parameters, which the moving-average update replaces through ``ma_params.data =``
(new storage every step), outside the step, after the optimizer's update."""
import copy
from functools import wraps

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import Trainer

from .harness import assert_same, batches, checks, compare, fixed

IMAGE, BATCH, STEPS, LR = 8, 4, 6, 3e-4  # the README's Adam(lr=3e-4)


# -- byol_pytorch/byol_pytorch.py ------------------------------------------------------------------------
def default(val, def_val):
    return def_val if val is None else val


def flatten(t):
    return t.reshape(t.shape[0], -1)


def singleton(cache_key):
    def inner_fn(fn):
        @wraps(fn)
        def wrapper(self, *args, **kwargs):
            instance = getattr(self, cache_key)
            if instance is not None:
                return instance
            instance = fn(self, *args, **kwargs)
            setattr(self, cache_key, instance)
            return instance
        return wrapper
    return inner_fn


def get_module_device(module):
    return next(module.parameters()).device


def set_requires_grad(model, val):
    for p in model.parameters():
        p.requires_grad = val


def cosine_loss_fn(x, y):
    x = F.normalize(x, dim=-1, p=2)
    y = F.normalize(y, dim=-1, p=2)
    return 2 - 2 * (x * y).sum(dim=-1)


class SEM(nn.Module):
    """Simplicial embeddings; einops' ``rearrange`` written as the unflatten / flatten it does."""

    def __init__(self, dim, temperature=0.1, dim_simplex=8):
        super().__init__()
        assert dim % dim_simplex == 0, f'{dim} must be divisible by {dim_simplex}'
        self.dim, self.dim_simplex, self.temperature = dim, dim_simplex, temperature

    def forward(self, t):
        t = t.unflatten(-1, (-1, self.dim_simplex))  # '... (l v) -> ... l v'
        t = (t / self.temperature).softmax(dim=-1)
        return t.flatten(-2)  # '... l v -> ... (l v)'


class EMA():
    def __init__(self, beta):
        super().__init__()
        self.beta = beta

    def update_average(self, old, new):
        if old is None:
            return new
        return old * self.beta + (1 - self.beta) * new


def update_moving_average(ema_updater, ma_model, current_model):
    for current_params, ma_params in zip(current_model.parameters(), ma_model.parameters()):
        old_weight, up_weight = ma_params.data, current_params.data
        ma_params.data = ema_updater.update_average(old_weight, up_weight)


def MLP(dim, projection_size, hidden_size=4096):
    # MaybeSyncBatchnorm: plain BatchNorm1d in one process
    return nn.Sequential(nn.Linear(dim, hidden_size), nn.BatchNorm1d(hidden_size), nn.ReLU(inplace=True),
                         nn.Linear(hidden_size, projection_size))


class NetWrapper(nn.Module):
    """The source's, less the SimSiam MLP (``use_momentum=True`` never builds it)."""

    def __init__(self, net, projection_size, projection_hidden_size, layer=-2, use_simplicial_embeddings=False,
                 sem_num_simplices=32, sem_simplex_dim=8, sem_temperature=0.1):
        super().__init__()
        self.net = net
        self.layer = layer
        self.projector = None
        self.projection_size = projection_size
        self.projection_hidden_size = projection_hidden_size
        self.use_simplicial_embeddings = use_simplicial_embeddings
        self.sem_num_simplices = sem_num_simplices
        self.sem_simplex_dim = sem_simplex_dim
        self.sem_temperature = sem_temperature
        self.hidden = {}
        self.hook_registered = False

    def _find_layer(self):
        if type(self.layer) == str:
            modules = dict([*self.net.named_modules()])
            return modules.get(self.layer, None)
        elif type(self.layer) == int:
            children = [*self.net.children()]
            return children[self.layer]
        return None

    def _hook(self, _, input, output):
        device = input[0].device
        self.hidden[device] = flatten(output)

    def _register_hook(self):
        layer = self._find_layer()
        assert layer is not None, f'hidden layer ({self.layer}) not found'
        layer.register_forward_hook(self._hook)
        self.hook_registered = True

    @singleton('projector')
    def _get_projector(self, hidden):
        _, dim = hidden.shape
        projector_input_dim = dim
        if self.use_simplicial_embeddings:
            sem_dim = self.sem_num_simplices * self.sem_simplex_dim
            projector_input_dim = sem_dim
        projector = MLP(projector_input_dim, self.projection_size, self.projection_hidden_size)
        if self.use_simplicial_embeddings:
            embedder = nn.Sequential(nn.Linear(dim, sem_dim), nn.BatchNorm1d(sem_dim))
            sem = SEM(sem_dim, temperature=self.sem_temperature, dim_simplex=self.sem_simplex_dim)
            projector = nn.Sequential(embedder, sem, projector)
        return projector.to(hidden)

    def get_representation(self, x):
        if self.layer == -1:
            return self.net(x)
        if not self.hook_registered:
            self._register_hook()
        self.hidden.clear()
        _ = self.net(x)
        hidden = self.hidden[x.device]
        self.hidden.clear()
        assert hidden is not None, f'hidden layer {self.layer} never emitted an output'
        return hidden

    def forward(self, x, return_projection=True):
        representation = self.get_representation(x)
        if not return_projection:
            return representation
        projector = self._get_projector(representation)
        projection = projector(representation)
        return projection, representation


class BYOL(nn.Module):
    """The source's, with ``augment_fn`` required (the default is torchvision's SimCLR pipeline)."""

    def __init__(self, net, image_size, hidden_layer=-2, projection_size=256, projection_hidden_size=4096,
                 augment_fn=None, augment_fn2=None, moving_average_decay=0.99, use_momentum=True,
                 use_simplicial_embeddings=True, sem_num_simplices=32, sem_simplex_dim=8, sem_temperature=0.1):
        super().__init__()
        self.net = net
        self.augment1 = augment_fn
        self.augment2 = default(augment_fn2, self.augment1)
        self.online_encoder = NetWrapper(net, projection_size, projection_hidden_size, layer=hidden_layer,
                                         use_simplicial_embeddings=use_simplicial_embeddings,
                                         sem_num_simplices=sem_num_simplices, sem_simplex_dim=sem_simplex_dim,
                                         sem_temperature=sem_temperature)
        self.use_momentum = use_momentum
        self.target_encoder = None
        self.target_ema_updater = EMA(moving_average_decay)
        self.online_predictor = MLP(projection_size, projection_size, projection_hidden_size)
        device = get_module_device(net)
        self.to(device)
        # send a mock image tensor to instantiate singleton parameters
        self.forward(torch.randn(2, 3, image_size, image_size, device=device))

    @singleton('target_encoder')
    def _get_target_encoder(self):
        target_encoder = copy.deepcopy(self.online_encoder)
        set_requires_grad(target_encoder, False)
        return target_encoder

    def update_moving_average(self):
        assert self.use_momentum, 'you do not need to update the moving average'
        assert self.target_encoder is not None, 'target encoder has not been created yet'
        update_moving_average(self.target_ema_updater, self.target_encoder, self.online_encoder)

    def forward(self, x, return_embedding=False, return_projection=True):
        assert not (self.training and x.shape[0] == 1), 'you must have greater than 1 sample when training'
        if return_embedding:
            return self.online_encoder(x, return_projection=return_projection)

        image_one, image_two = self.augment1(x), self.augment2(x)
        images = torch.cat((image_one, image_two), dim=0)
        online_projections, _ = self.online_encoder(images)
        online_predictions = self.online_predictor(online_projections)
        online_pred_one, online_pred_two = online_predictions.chunk(2, dim=0)

        with torch.no_grad():
            target_encoder = self._get_target_encoder() if self.use_momentum else self.online_encoder
            target_projections, _ = target_encoder(images)
            target_projections = target_projections.detach()
            target_proj_one, target_proj_two = target_projections.chunk(2, dim=0)

        loss_one = cosine_loss_fn(online_pred_one, target_proj_two.detach())
        loss_two = cosine_loss_fn(online_pred_two, target_proj_one.detach())
        loss = loss_one + loss_two
        return loss.mean()


# -- the README's usage, scaled down -----------------------------------------------------------------------
class TinyResNet(nn.Module):
    """Stands in for torchvision's ResNet: conv, BatchNorm, ``avgpool`` (the hidden layer the README names)
    and an ``fc`` head that BYOL never trains (the hook takes the representation before it)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.avgpool(self.relu(self.bn1(self.conv1(x)))), 1))


class Augment(nn.Module):
    """Stands in for the SimCLR augmentations: a flip of the batch half the time and some noise, drawn
    from torch's RNG (which the comparison seeds alike for both runs)."""

    def forward(self, x):
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x + 0.1 * torch.randn_like(x)


def learner():
    # 2 simplices of 4: the projector's input is 8 wide, as the default 32 x 8 is 256
    return BYOL(TinyResNet(), image_size=IMAGE, hidden_layer='avgpool', projection_size=4, projection_hidden_size=8,
                augment_fn=Augment(), sem_num_simplices=2, sem_simplex_dim=4)


def byol_opt(params):
    return torch.optim.Adam(params, lr=LR)


def byol_hand(learner, data):
    opt = byol_opt(learner.parameters())  # the target encoder's frozen parameters too: Adam skips them
    for images in data:
        loss = learner(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        learner.update_moving_average()  # update moving average of target encoder


class BYOLTrainer(Trainer):
    """The learner is the Trainer's model; the moving average follows each update, in on_step_end."""

    def configure_optimizers(self):
        return byol_opt(self.model.parameters())

    def training_step(self, images):
        return self.model(images)

    def on_step_end(self, losses):
        self.model.update_moving_average()


def images(n=STEPS):
    return batches(n, (BATCH, 3, IMAGE, IMAGE))


@pytest.mark.parametrize("check", checks())
def test_byol(check):
    compare(learner, byol_hand, BYOLTrainer, fixed(images()), check, steps=STEPS)


def run(checkpoint_dir, steps, resume=None):
    """A run in a fresh process would start so: the learner built (its mock forward included) from the seed."""
    torch.manual_seed(0)
    model = learner()
    torch.manual_seed(1)
    trainer = BYOLTrainer(model=model, train_data=images(), max_steps=steps, device="cpu", progress=False,
                          loggers=(), checkpoint={"dir": str(checkpoint_dir)}, resume=resume)
    trainer.fit()
    return trainer


@pytest.mark.filterwarnings("error")
def test_byol_resumed_midway(tmp_path):
    """The lazily made projector and target encoder are rebuilt by the new learner's mock forward and
    take the checkpoint's values; the target's parameters, given new storage by every moving-average
    update, are loaded into the new learner's and go on from there."""
    straight = run(tmp_path / "straight", STEPS)
    run(tmp_path / "stopped", STEPS // 2)
    resumed = run(tmp_path / "stopped", STEPS, resume="auto")
    assert resumed.state.step == STEPS
    assert_same(resumed.model, straight.model)
