"""An orthogonal RNN on the copying problem: lezcano/geotorch at commit 09273b186332957ed7d2db92a1b897967d03684a,
examples/copying_problem.py (``modrelu``, ``ExpRNNCell``, ``Model``, ``copy_data``, ``main``).

The recurrent kernel's weight is a parametrization (``orthogonal``): each access computes it from the unconstrained
parameter. ``Model.forward`` runs the whole sequence inside ``parametrize.cached()``: the orthogonal weight is
computed once, at the first time step, and that one tensor, saved by every time step's matmul, is reused until
the context exits and drops the cache. The optimizer holds two parameter groups, the orthogonal layer's
parameters at their own learning rate and betas.

Changes for a seconds-long test: sequences of 2 + 3 + 2 (K = 10, L = 1000), a hidden size of 6 (190), batches of 4
(128), 4 iterations (4000), on the CPU; PyTorch's own ``torch.nn.utils.parametrizations.orthogonal`` for
``geotorch.orthogonal`` (the same author's port of it; ``geotorch.parametrize`` is ``torch.nn.utils.parametrize``),
so the initial weight assigned in ``reset_parameters`` is a QR factor rather than geotorch's ``M.sample("torus")``;
no printing. ``RGD`` is False, as in the source.

The port's data iterator draws each batch with ``copy_data`` as the loop does; ``configure_optimizers`` builds the
source's Adam with its two groups.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal

from safeloop import Trainer

from .harness import checks, compare

batch_size = 4
hidden_size = 6
iterations = 4  # Training iterations
L = 3  # Length of sequence before asking to remember
K = 2  # Length of sequence to remember
n_classes = 9  # Number of possible classes
lr = 1e-3
lr_orth = 2e-4
device = torch.device("cpu")


class modrelu(nn.Module):
    def __init__(self, features):
        super(modrelu, self).__init__()
        self.features = features
        self.b = nn.Parameter(torch.Tensor(self.features))
        self.reset_parameters()

    def reset_parameters(self):
        self.b.data.uniform_(-0.01, 0.01)

    def forward(self, inputs):
        norm = torch.abs(inputs)
        biased_norm = norm + self.b
        magnitude = nn.functional.relu(biased_norm)
        phase = torch.sign(inputs)

        return phase * magnitude


class ExpRNNCell(nn.Module):
    def __init__(self, input_size, hidden_size):
        super(ExpRNNCell, self).__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.recurrent_kernel = nn.Linear(hidden_size, hidden_size, bias=False)
        self.input_kernel = nn.Linear(input_size, hidden_size)
        self.nonlinearity = modrelu(hidden_size)

        # Make recurrent_kernel orthogonal
        orthogonal(self.recurrent_kernel, "weight")

        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_normal_(self.input_kernel.weight.data, nonlinearity="relu")
        # an orthogonal initial weight, assigned through the parametrization's right inverse
        self.recurrent_kernel.weight = torch.linalg.qr(torch.randn(self.hidden_size, self.hidden_size))[0]

    def default_hidden(self, input_):
        return input_.new_zeros(input_.size(0), self.hidden_size, requires_grad=False)

    def forward(self, input_, hidden):
        input_ = self.input_kernel(input_)
        hidden = self.recurrent_kernel(hidden)
        out = input_ + hidden
        return self.nonlinearity(out)


class Model(nn.Module):
    def __init__(self, n_classes, hidden_size):
        super(Model, self).__init__()
        self.hidden_size = hidden_size
        self.rnn = ExpRNNCell(n_classes + 1, hidden_size)
        self.lin = nn.Linear(hidden_size, n_classes)
        self.loss_func = nn.CrossEntropyLoss()
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_normal_(self.lin.weight.data, nonlinearity="relu")
        nn.init.constant_(self.lin.bias.data, 0)

    def forward(self, inputs):
        out_rnn = self.rnn.default_hidden(inputs[:, 0, ...])
        outputs = []
        with parametrize.cached():
            for input in torch.unbind(inputs, dim=1):
                out_rnn = self.rnn(input, out_rnn)
                outputs.append(self.lin(out_rnn))
        return torch.stack(outputs, dim=1)

    def loss(self, logits, y):
        return self.loss_func(logits.view(-1, 9), y.view(-1))

    def accuracy(self, logits, y):
        return torch.eq(torch.argmax(logits, dim=2), y).float().mean()


def copy_data(batch_size):
    seq = torch.randint(1, n_classes, (batch_size, K), dtype=torch.long, device=device)
    zeros1 = torch.zeros((batch_size, L), dtype=torch.long, device=device)
    zeros2 = torch.zeros((batch_size, K - 1), dtype=torch.long, device=device)
    zeros3 = torch.zeros((batch_size, K + L), dtype=torch.long, device=device)
    marker = torch.full((batch_size, 1), n_classes, dtype=torch.long, device=device)

    x = torch.cat([seq, zeros1, marker, zeros2], dim=1)
    y = torch.cat([zeros3, seq], dim=1)

    return x, y


def make_optimizer(model):
    p_orth = model.rnn.recurrent_kernel
    orth_params = p_orth.parameters()
    non_orth_params = (
        param for param in model.parameters() if param not in set(p_orth.parameters())
    )
    return torch.optim.Adam(
        [
            {"params": non_orth_params},
            {"params": orth_params, "lr": lr_orth, "betas": (0.9, 0.99)},
        ],
        lr=lr,
    )


def main(model, data):
    optim = make_optimizer(model)

    model.train()
    for step in range(iterations):
        batch_x, batch_y = copy_data(batch_size)
        x_onehot = F.one_hot(batch_x, num_classes=n_classes + 1).float()
        logits = model(x_onehot)
        loss = model.loss(logits, batch_y)

        optim.zero_grad()
        loss.backward()
        optim.step()

        with torch.no_grad():
            accuracy = model.accuracy(logits, batch_y)


class CopyData:
    def __len__(self):
        return iterations

    def __iter__(self):
        for _ in range(iterations):
            yield copy_data(batch_size)


class CopyingTrainer(Trainer):
    def configure_optimizers(self):
        return make_optimizer(self.model)

    def training_step(self, batch):
        batch_x, batch_y = batch
        x_onehot = F.one_hot(batch_x, num_classes=n_classes + 1).float()
        logits = self.model(x_onehot)
        with torch.no_grad():
            self.log("accuracy", self.model.accuracy(logits, batch_y))
        return self.model.loss(logits, batch_y)


@pytest.mark.parametrize("check", checks())
def test_orthogonal_rnn_with_the_parametrization_cached_over_the_sequence(check):
    compare(lambda: Model(n_classes, hidden_size), main, CopyingTrainer, lambda model: CopyData(), check,
            steps=iterations)
