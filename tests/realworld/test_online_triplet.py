"""Online triplet mining: adambielski/siamese-triplet at commit 4ed17efa6b2850c5cbef0b3986eae7c94eb1d6a1, losses.py
(``OnlineTripletLoss``), utils.py (``pdist``, ``FunctionNegativeTripletSelector``, ``random_hard_negative``,
``RandomNegativeTripletSelector``), networks.py (``EmbeddingNetL2``), trainer.py (``fit``, ``train_epoch``), with
the README's online-triplet setup (Adam with weight decay, ``StepLR``, ``margin = 1.``).

The loss mines its triplets from the batch's own embeddings: ``pdist`` builds a distance matrix *with* its graph
(no ``no_grad``), read through ``.data.cpu().numpy()``, a negative drawn per anchor-positive pair by NumPy's global
``np.random.choice`` among those that violate the margin; the chosen index triplets (a ``LongTensor``) index the
embeddings again for the loss. The distance matrix's graph, over the same embeddings, is never back-propagated.
``EmbeddingNetL2`` normalizes its output in place (``output /= ...``). ``fit`` steps the scheduler at the start of
each epoch, before any ``optimizer.step()`` (PyTorch warns); the loss function returns ``(loss, n_triplets)``.

Changes for a seconds-long test: one 3x3 conv and a 16-8-2 head (the source's two 5x5 convs and 1024-256-256-2)
over 1x6x6 images; balanced batches of 3 classes x 3 samples (``BalancedBatchSampler``), 2 epochs of 2 batches;
``StepLR(step_size=1)`` (8); ``loss.data[0]`` (a 0-dim tensor's index, an error today) read as ``loss.item()``;
no CUDA, metrics, logging or validation.

The port returns the loss's first output from ``training_step`` and steps the scheduler in ``on_epoch_start``.
"""
from itertools import combinations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.autograd import Variable
from torch.optim import lr_scheduler

from safeloop import Trainer

from .harness import checks, compare

MARGIN, LR, EPOCHS, PER_EPOCH, N_CLASSES, N_SAMPLES = 1., 1e-3, 2, 2, 3, 3


# -- networks.py --------------------------------------------------------------------------------------------
class EmbeddingNet(nn.Module):
    def __init__(self):
        super(EmbeddingNet, self).__init__()
        self.convnet = nn.Sequential(nn.Conv2d(1, 4, 3), nn.PReLU(),
                                     nn.MaxPool2d(2, stride=2))

        self.fc = nn.Sequential(nn.Linear(4 * 2 * 2, 8),
                                nn.PReLU(),
                                nn.Linear(8, 2)
                                )

    def forward(self, x):
        output = self.convnet(x)
        output = output.view(output.size()[0], -1)
        output = self.fc(output)
        return output


class EmbeddingNetL2(EmbeddingNet):
    def __init__(self):
        super(EmbeddingNetL2, self).__init__()

    def forward(self, x):
        output = super(EmbeddingNetL2, self).forward(x)
        output /= output.pow(2).sum(1, keepdim=True).sqrt()
        return output


# -- utils.py -----------------------------------------------------------------------------------------------
def pdist(vectors):
    distance_matrix = -2 * vectors.mm(torch.t(vectors)) + vectors.pow(2).sum(dim=1).view(1, -1) + vectors.pow(2).sum(
        dim=1).view(-1, 1)
    return distance_matrix


def random_hard_negative(loss_values):
    hard_negatives = np.where(loss_values > 0)[0]
    return np.random.choice(hard_negatives) if len(hard_negatives) > 0 else None


class FunctionNegativeTripletSelector:
    def __init__(self, margin, negative_selection_fn, cpu=True):
        self.cpu = cpu
        self.margin = margin
        self.negative_selection_fn = negative_selection_fn

    def get_triplets(self, embeddings, labels):
        if self.cpu:
            embeddings = embeddings.cpu()
        distance_matrix = pdist(embeddings)
        distance_matrix = distance_matrix.cpu()

        labels = labels.cpu().data.numpy()
        triplets = []

        for label in set(labels):
            label_mask = (labels == label)
            label_indices = np.where(label_mask)[0]
            if len(label_indices) < 2:
                continue
            negative_indices = np.where(np.logical_not(label_mask))[0]
            anchor_positives = list(combinations(label_indices, 2))  # All anchor-positive pairs
            anchor_positives = np.array(anchor_positives)

            ap_distances = distance_matrix[anchor_positives[:, 0], anchor_positives[:, 1]]
            for anchor_positive, ap_distance in zip(anchor_positives, ap_distances):
                loss_values = ap_distance - distance_matrix[torch.LongTensor(np.array([anchor_positive[0]])),
                                                            torch.LongTensor(negative_indices)] + self.margin
                loss_values = loss_values.data.cpu().numpy()
                hard_negative = self.negative_selection_fn(loss_values)
                if hard_negative is not None:
                    hard_negative = negative_indices[hard_negative]
                    triplets.append([anchor_positive[0], anchor_positive[1], hard_negative])

        if len(triplets) == 0:
            triplets.append([anchor_positive[0], anchor_positive[1], negative_indices[0]])

        triplets = np.array(triplets)

        return torch.LongTensor(triplets)


def RandomNegativeTripletSelector(margin, cpu=False): return FunctionNegativeTripletSelector(
    margin=margin, negative_selection_fn=random_hard_negative, cpu=cpu)


# -- losses.py ----------------------------------------------------------------------------------------------
class OnlineTripletLoss(nn.Module):
    def __init__(self, margin, triplet_selector):
        super(OnlineTripletLoss, self).__init__()
        self.margin = margin
        self.triplet_selector = triplet_selector

    def forward(self, embeddings, target):

        triplets = self.triplet_selector.get_triplets(embeddings, target)

        if embeddings.is_cuda:
            triplets = triplets.cuda()

        ap_distances = (embeddings[triplets[:, 0]] - embeddings[triplets[:, 1]]).pow(2).sum(1)  # .pow(.5)
        an_distances = (embeddings[triplets[:, 0]] - embeddings[triplets[:, 2]]).pow(2).sum(1)  # .pow(.5)
        losses = F.relu(ap_distances - an_distances + self.margin)

        return losses.mean(), len(triplets)


# -- trainer.py ---------------------------------------------------------------------------------------------
def fit(train_loader, model, loss_fn, optimizer, scheduler, n_epochs, start_epoch=0):
    for epoch in range(0, start_epoch):
        scheduler.step()

    for epoch in range(start_epoch, n_epochs):
        scheduler.step()

        # Train stage
        train_loss = train_epoch(train_loader, model, loss_fn, optimizer)


def train_epoch(train_loader, model, loss_fn, optimizer):
    model.train()
    losses = []
    total_loss = 0

    for batch_idx, (data, target) in enumerate(train_loader):
        target = target if len(target) > 0 else None
        if not type(data) in (tuple, list):
            data = (data,)
        data = tuple(Variable(d) for d in data)

        optimizer.zero_grad()
        outputs = model(*data)

        if type(outputs) not in (tuple, list):
            outputs = (outputs,)

        loss_inputs = outputs
        if target is not None:
            target = Variable(target)
            target = (target,)
            loss_inputs += target

        loss_outputs = loss_fn(*loss_inputs)
        loss = loss_outputs[0] if type(loss_outputs) in (tuple, list) else loss_outputs
        losses.append(loss.item())
        total_loss += loss.item()
        loss.backward()
        optimizer.step()

    total_loss /= (batch_idx + 1)
    return total_loss


# -- the README's online triplet setup ----------------------------------------------------------------------
def make_optimizer(params):
    return optim.Adam(params, lr=LR, weight_decay=1e-4)


def make_scheduler(optimizer):
    return lr_scheduler.StepLR(optimizer, 1, gamma=0.1, last_epoch=-1)  # StepLR(optimizer, 8, ...)


loss_fn = OnlineTripletLoss(MARGIN, RandomNegativeTripletSelector(MARGIN))


def triplet_hand(model, online_train_loader):
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer)
    fit(online_train_loader, model, loss_fn, optimizer, scheduler, EPOCHS)


class TripletTrainer(Trainer):
    def configure_optimizers(self):
        optimizer = make_optimizer(self.model.parameters())
        self.scheduler = make_scheduler(optimizer)
        return optimizer

    def on_epoch_start(self):
        self.scheduler.step()

    def training_step(self, batch):
        data, target = batch
        return loss_fn(self.model(data), target)[0]


def balanced_batches(model):
    """``BalancedBatchSampler``'s batches: N_CLASSES classes of N_SAMPLES each; NumPy seeded for the mining."""
    np.random.seed(7)
    gen = torch.Generator().manual_seed(8)
    labels = torch.arange(N_CLASSES).repeat_interleave(N_SAMPLES)
    return [(torch.rand(N_CLASSES * N_SAMPLES, 1, 6, 6, generator=gen), labels[torch.randperm(len(labels),
                                                                                           generator=gen)])
            for _ in range(PER_EPOCH)]


@pytest.mark.parametrize("check", checks())
def test_online_triplet_mining_on_the_batch_embeddings(check):
    compare(EmbeddingNet, triplet_hand, TripletTrainer, balanced_batches, check, steps=EPOCHS * PER_EPOCH)


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_the_l2_net_as_written_fails_in_place_and_watch_and_the_port_name_it(tmp_path, monkeypatch):
    """``EmbeddingNetL2`` divides in place the output that its own ``output.pow(2)`` saved: PyTorch's backward
    refuses it at the first batch. Under watch and in the port the error names the step, the loss and the fix,
    and the port leaves the parameters as they were."""
    monkeypatch.chdir(tmp_path)  # watch's graph picture
    from safeloop import GraphGuard
    from safeloop.errors import SafeloopError
    from safeloop.watch import Watch

    def model():
        torch.manual_seed(0)
        return EmbeddingNetL2()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        net = model()
        triplet_hand(net, balanced_batches(net))
    with Watch(GraphGuard(), triplet_hand.__code__.co_filename), \
            pytest.raises(SafeloopError, match=r"modified in place \(step 1, loss 'loss'\).*out-of-place form"):
        net = model()
        triplet_hand(net, balanced_batches(net))
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(SafeloopError, match=r"modified in place \(step 1, loss 'loss'\).*abandoned"):
        TripletTrainer(model=net, train_data=balanced_batches(net), max_steps=2, device="cpu", progress=False,
                       loggers=()).fit()
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
