"""A sparsely-gated mixture-of-experts layer with its load-balancing loss: davidmrau/mixture-of-experts at commit
f662999727109357c42074997e9a6cd72806f668, moe.py (``SparseDispatcher``, ``MLP``, ``MoE``) and cifar10_example.py
(the training loop and the test pass).

Noisy top-k gating: clean logits ``x @ w_gate`` (zeros at first), noise scaled by ``softplus(x @ w_noise)`` from
``torch.randn_like``, a softmax, ``topk`` of k + 1, the top k renormalized and scattered into
``torch.zeros_like(logits, requires_grad=True)`` (a new leaf that requires grad, every forward). The load is the
probability of each expert being in the top k under the noise (``Normal(self.mean, self.std).cdf`` over buffers,
``torch.where``, ``gather`` of thresholds), the auxiliary loss ``cv_squared(importance) + cv_squared(load)``
scaled in place (``loss *= loss_coef``). ``SparseDispatcher`` sorts ``torch.nonzero(gates)``, sends each expert
its rows (``torch.split`` by sizes read with ``.tolist()``; an expert may get none) and sums the gated outputs
with ``index_add`` into ``torch.zeros(..., requires_grad=True)``, another leaf. The loop adds the auxiliary loss
to the cross-entropy and back-propagates the sum; after training, a test pass in eval mode under ``no_grad`` (the
load then counts gates, an integer tensor).

Changes for a seconds-long test: 3x2x2 inputs (12 features for 3072), 3 classes, 4 experts of 8 hidden units,
``k=2``, batches of 8, 4 steps, 2 test batches; the printing left out, CUDA left out.

The ports return the sum, as the loop back-propagates it, or both terms by name with ``multi_loss="sum"``.
"""
import torch
import torch.nn as nn
import torch.optim as optim
import pytest
from functools import partial
from torch.distributions.normal import Normal

from safeloop import Trainer

from .harness import checks, compare

STEPS, BATCH, INPUT, CLASSES, EXPERTS, HIDDEN, K = 4, 8, 12, 3, 4, 8, 2


# -- moe.py ---------------------------------------------------------------------------------------------------
class SparseDispatcher(object):
    """See moe.py: dispatches each batch element to the experts whose gate is nonzero and sums their gated
    outputs."""

    def __init__(self, num_experts, gates):
        """Create a SparseDispatcher."""

        self._gates = gates
        self._num_experts = num_experts
        # sort experts
        sorted_experts, index_sorted_experts = torch.nonzero(gates).sort(0)
        # drop indices
        _, self._expert_index = sorted_experts.split(1, dim=1)
        # get according batch index for each expert
        self._batch_index = torch.nonzero(gates)[index_sorted_experts[:, 1], 0]
        # calculate num samples that each expert gets
        self._part_sizes = (gates > 0).sum(0).tolist()
        # expand gates to match with self._batch_index
        gates_exp = gates[self._batch_index.flatten()]
        self._nonzero_gates = torch.gather(gates_exp, 1, self._expert_index)

    def dispatch(self, inp):
        # assigns samples to experts whose gate is nonzero

        # expand according to batch index so we can just split by _part_sizes
        inp_exp = inp[self._batch_index].squeeze(1)
        return torch.split(inp_exp, self._part_sizes, dim=0)

    def combine(self, expert_out, multiply_by_gates=True):
        # apply exp to expert outputs, so we are not longer in log space
        stitched = torch.cat(expert_out, 0)

        if multiply_by_gates:
            stitched = stitched.mul(self._nonzero_gates)
        zeros = torch.zeros(self._gates.size(0), expert_out[-1].size(1), requires_grad=True, device=stitched.device)
        # combine samples that have been processed by the same k experts
        combined = zeros.index_add(0, self._batch_index, stitched.float())
        return combined

    def expert_to_gates(self):
        # split nonzero gates for each expert
        return torch.split(self._nonzero_gates, self._part_sizes, dim=0)


class MLP(nn.Module):
    def __init__(self, input_size, output_size, hidden_size):
        super(MLP, self).__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, output_size)
        self.relu = nn.ReLU()
        self.soft = nn.Softmax(1)

    def forward(self, x):
        out = self.fc1(x)
        out = self.relu(out)
        out = self.fc2(out)
        out = self.soft(out)
        return out


class MoE(nn.Module):
    """See moe.py: a sparsely gated mixture of experts layer with 1-layer feed-forward networks as experts."""

    def __init__(self, input_size, output_size, num_experts, hidden_size, noisy_gating=True, k=4):
        super(MoE, self).__init__()
        self.noisy_gating = noisy_gating
        self.num_experts = num_experts
        self.output_size = output_size
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.k = k
        # instantiate experts
        self.experts = nn.ModuleList([MLP(self.input_size, self.output_size, self.hidden_size)
                                      for i in range(self.num_experts)])
        self.w_gate = nn.Parameter(torch.zeros(input_size, num_experts), requires_grad=True)
        self.w_noise = nn.Parameter(torch.zeros(input_size, num_experts), requires_grad=True)

        self.softplus = nn.Softplus()
        self.softmax = nn.Softmax(1)
        self.register_buffer("mean", torch.tensor([0.0]))
        self.register_buffer("std", torch.tensor([1.0]))
        assert(self.k <= self.num_experts)

    def cv_squared(self, x):
        eps = 1e-10
        # if only num_experts = 1

        if x.shape[0] == 1:
            return torch.tensor([0], device=x.device, dtype=x.dtype)
        return x.float().var() / (x.float().mean()**2 + eps)

    def _gates_to_load(self, gates):
        return (gates > 0).sum(0)

    def _prob_in_top_k(self, clean_values, noisy_values, noise_stddev, noisy_top_values):
        batch = clean_values.size(0)
        m = noisy_top_values.size(1)
        top_values_flat = noisy_top_values.flatten()

        threshold_positions_if_in = torch.arange(batch, device=clean_values.device) * m + self.k
        threshold_if_in = torch.unsqueeze(torch.gather(top_values_flat, 0, threshold_positions_if_in), 1)
        is_in = torch.gt(noisy_values, threshold_if_in)
        threshold_positions_if_out = threshold_positions_if_in - 1
        threshold_if_out = torch.unsqueeze(torch.gather(top_values_flat, 0, threshold_positions_if_out), 1)
        # is each value currently in the top k.
        normal = Normal(self.mean, self.std)
        prob_if_in = normal.cdf((clean_values - threshold_if_in)/noise_stddev)
        prob_if_out = normal.cdf((clean_values - threshold_if_out)/noise_stddev)
        prob = torch.where(is_in, prob_if_in, prob_if_out)
        return prob

    def noisy_top_k_gating(self, x, train, noise_epsilon=1e-2):
        clean_logits = x @ self.w_gate
        if self.noisy_gating and train:
            raw_noise_stddev = x @ self.w_noise
            noise_stddev = ((self.softplus(raw_noise_stddev) + noise_epsilon))
            noisy_logits = clean_logits + (torch.randn_like(clean_logits) * noise_stddev)
            logits = noisy_logits
        else:
            logits = clean_logits

        # calculate topk + 1 that will be needed for the noisy gates
        logits = self.softmax(logits)
        top_logits, top_indices = logits.topk(min(self.k + 1, self.num_experts), dim=1)
        top_k_logits = top_logits[:, :self.k]
        top_k_indices = top_indices[:, :self.k]
        top_k_gates = top_k_logits / (top_k_logits.sum(1, keepdim=True) + 1e-6)  # normalization

        zeros = torch.zeros_like(logits, requires_grad=True)
        gates = zeros.scatter(1, top_k_indices, top_k_gates)

        if self.noisy_gating and self.k < self.num_experts and train:
            load = (self._prob_in_top_k(clean_logits, noisy_logits, noise_stddev, top_logits)).sum(0)
        else:
            load = self._gates_to_load(gates)
        return gates, load

    def forward(self, x, loss_coef=1e-2):
        gates, load = self.noisy_top_k_gating(x, self.training)
        # calculate importance loss
        importance = gates.sum(0)
        #
        loss = self.cv_squared(importance) + self.cv_squared(load)
        loss *= loss_coef

        dispatcher = SparseDispatcher(self.num_experts, gates)
        expert_inputs = dispatcher.dispatch(x)
        gates = dispatcher.expert_to_gates()
        expert_outputs = [self.experts[i](expert_inputs[i]) for i in range(self.num_experts)]
        y = dispatcher.combine(expert_outputs)
        return y, loss


# -- cifar10_example.py ---------------------------------------------------------------------------------------
def test_pass(net, testloader):
    correct = 0
    total = 0
    net.eval()
    with torch.no_grad():
        for data in testloader:
            images, labels = data
            outputs, _ = net(images.view(images.shape[0], -1))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels).sum().item()
    return correct / total


test_pass.__test__ = False  # not a pytest test


def moe_hand(net, data):
    trainloader, testloader = data
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(net.parameters(), lr=0.001)

    net.train()
    for epoch in range(1):  # loop over the dataset multiple times

        running_loss = 0.0
        for i, data in enumerate(trainloader, 0):
            # get the inputs; data is a list of [inputs, labels]
            inputs, labels = data

            # zero the parameter gradients
            optimizer.zero_grad()

            # forward + backward + optimize
            inputs = inputs.view(inputs.shape[0], -1)
            outputs, aux_loss = net(inputs)
            loss = criterion(outputs, labels)
            total_loss = loss + aux_loss
            total_loss.backward()
            optimizer.step()

            # print statistics
            running_loss += loss.item()

    test_pass(net, testloader)


def moe():
    return MoE(input_size=INPUT, output_size=CLASSES, num_experts=EXPERTS, hidden_size=HIDDEN, noisy_gating=True, k=K)


def images(model):
    gen = torch.Generator().manual_seed(2)
    make = lambda: (torch.randn(BATCH, 3, 2, 2, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
    return [make() for _ in range(STEPS)], [make() for _ in range(2)]


class MoETrainer(Trainer):
    testloader: list

    def terms(self, batch):
        inputs, labels = batch
        outputs, aux_loss = self.model(inputs.view(inputs.shape[0], -1))
        return nn.CrossEntropyLoss()(outputs, labels), aux_loss

    def training_step(self, batch):
        loss, aux_loss = self.terms(batch)
        return loss + aux_loss

    def on_fit_end(self):
        test_pass(self.model, self.testloader)


class NamedTerms(MoETrainer):
    def training_step(self, batch):
        loss, aux_loss = self.terms(batch)
        return {"ce": loss, "aux": aux_loss}


def port(model, train_data, kind=MoETrainer, **kwargs):
    """The Trainer over the training batches, given the test batches."""
    trainer = kind(model=model, train_data=train_data[0], **kwargs)
    trainer.testloader = train_data[1]
    return trainer


@pytest.mark.parametrize("check", checks())
def test_mixture_of_experts_with_a_load_balancing_loss(check):
    compare(moe, moe_hand, port, images, check, steps=STEPS, optimizer=partial(optim.Adam, lr=0.001))


@pytest.mark.parametrize("check", checks())
def test_mixture_of_experts_with_its_two_terms_summed_by_the_trainer(check):
    compare(moe, moe_hand, partial(port, kind=NamedTerms), images, check, steps=STEPS,
            optimizer=partial(optim.Adam, lr=0.001), multi_loss="sum")
