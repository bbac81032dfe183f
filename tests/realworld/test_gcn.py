"""A full-batch graph convolutional network: tkipf/pygcn, pygcn/layers.py at commit
bf1410eb6462771803ea9b8a09b9391c286f06c2 (``GraphConvolution``: ``torch.spmm`` of the sparse adjacency),
pygcn/models.py (``GCN``), pygcn/utils.py (``normalize``, ``accuracy``, ``sparse_mx_to_torch_sparse_tensor``)
and pygcn/train.py (``train``).

The whole graph is one batch, built once before training: the row-normalised features and the sparse,
symmetric, row-normalised adjacency with self-loops, reused by every step, with the label and index tensors.
Each epoch is one step: a forward in train mode (dropout), the loss on the training nodes, backward, Adam with
weight decay; then, without ``no_grad``, a second forward in eval mode for the validation loss and accuracy,
whose graph is dropped when ``train`` returns.

Changes for a seconds-long test: a random graph of 12 nodes, 6 features, 3 classes and a hidden layer of 4 (Cora,
16 hidden) for 5 epochs; the normalisation in NumPy on a dense matrix (SciPy's sparse matrices in the source),
and ``torch.sparse_coo_tensor`` for the removed ``torch.sparse.FloatTensor``; no timing.

The port gives the Trainer that one batch each step; ``training_step`` is ``train``'s first half, and
``on_step_end`` its validation forward, graph and all.
"""
from functools import partial

import math
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.module import Module
from torch.nn.parameter import Parameter

from safeloop import Trainer

from .harness import checks, compare

EPOCHS, NODES, NFEAT, NHID, NCLASS = 5, 12, 6, 4, 3
LR, WEIGHT_DECAY, DROPOUT = 0.01, 5e-4, 0.5


# -- pygcn/layers.py ----------------------------------------------------------------------------------------
class GraphConvolution(Module):
    """
    Simple GCN layer, similar to https://arxiv.org/abs/1609.02907
    """

    def __init__(self, in_features, out_features, bias=True):
        super(GraphConvolution, self).__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(torch.FloatTensor(in_features, out_features))
        if bias:
            self.bias = Parameter(torch.FloatTensor(out_features))
        else:
            self.register_parameter('bias', None)
        self.reset_parameters()

    def reset_parameters(self):
        stdv = 1. / math.sqrt(self.weight.size(1))
        self.weight.data.uniform_(-stdv, stdv)
        if self.bias is not None:
            self.bias.data.uniform_(-stdv, stdv)

    def forward(self, input, adj):
        support = torch.mm(input, self.weight)
        output = torch.spmm(adj, support)
        if self.bias is not None:
            return output + self.bias
        else:
            return output


# -- pygcn/models.py ----------------------------------------------------------------------------------------
class GCN(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout):
        super(GCN, self).__init__()

        self.gc1 = GraphConvolution(nfeat, nhid)
        self.gc2 = GraphConvolution(nhid, nclass)
        self.dropout = dropout

    def forward(self, x, adj):
        x = F.relu(self.gc1(x, adj))
        x = F.dropout(x, self.dropout, training=self.training)
        x = self.gc2(x, adj)
        return F.log_softmax(x, dim=1)


# -- pygcn/utils.py -----------------------------------------------------------------------------------------
def normalize(mx):
    """Row-normalize matrix"""
    rowsum = np.array(mx.sum(1))
    r_inv = np.power(rowsum, -1).flatten()
    r_inv[np.isinf(r_inv)] = 0.
    r_mat_inv = np.diag(r_inv)
    mx = r_mat_inv.dot(mx)
    return mx


def accuracy(output, labels):
    preds = output.max(1)[1].type_as(labels)
    correct = preds.eq(labels).double()
    correct = correct.sum()
    return correct / len(labels)


def sparse_mx_to_torch_sparse_tensor(mx):
    """Convert a (dense NumPy) matrix to a torch sparse tensor."""
    row, col = np.nonzero(mx)
    indices = torch.from_numpy(np.vstack((row, col)).astype(np.int64))
    values = torch.from_numpy(mx[row, col].astype(np.float32))
    return torch.sparse_coo_tensor(indices, values, torch.Size(mx.shape))


def load_data():
    """load_data's steps on a random graph."""
    rng = np.random.RandomState(7)
    features = (rng.rand(NODES, NFEAT) < 0.4).astype(np.float32)
    edges = rng.randint(NODES, size=(20, 2))
    adj = np.zeros((NODES, NODES), dtype=np.float32)
    adj[edges[:, 0], edges[:, 1]] = 1
    adj = np.maximum(adj, adj.T)  # build symmetric adjacency matrix
    features = normalize(features)
    adj = normalize(adj + np.eye(NODES, dtype=np.float32))
    features = torch.FloatTensor(features)
    labels = torch.LongTensor(rng.randint(NCLASS, size=NODES))
    adj = sparse_mx_to_torch_sparse_tensor(adj)
    idx_train, idx_val = torch.LongTensor(range(6)), torch.LongTensor(range(6, 10))
    return adj, features, labels, idx_train, idx_val


# -- pygcn/train.py -----------------------------------------------------------------------------------------
def make_gcn():
    return GCN(nfeat=NFEAT, nhid=NHID, nclass=NCLASS, dropout=DROPOUT)


def gcn_hand(model, data):
    adj, features, labels, idx_train, idx_val = data[0]  # the one batch, built once
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def train(epoch):
        model.train()
        optimizer.zero_grad()
        output = model(features, adj)
        loss_train = F.nll_loss(output[idx_train], labels[idx_train])
        acc_train = accuracy(output[idx_train], labels[idx_train])
        loss_train.backward()
        optimizer.step()

        # Evaluate validation set performance separately,
        # deactivates dropout during validation run.
        model.eval()
        output = model(features, adj)

        loss_val = F.nll_loss(output[idx_val], labels[idx_val])
        acc_val = accuracy(output[idx_val], labels[idx_val])
        return loss_train.item(), acc_train.item(), loss_val.item(), acc_val.item()

    for epoch in range(EPOCHS):
        train(epoch)


class GCNTrainer(Trainer):
    def training_step(self, batch):
        adj, features, labels, idx_train, idx_val = self.graph = batch
        output = self.model(features, adj)
        self.log("acc_train", accuracy(output[idx_train], labels[idx_train]))
        return F.nll_loss(output[idx_train], labels[idx_train])

    def on_step_end(self, losses):
        adj, features, labels, idx_train, idx_val = self.graph
        self.model.eval()
        output = self.model(features, adj)
        self.log("loss_val", F.nll_loss(output[idx_val], labels[idx_val]))
        self.log("acc_val", accuracy(output[idx_val], labels[idx_val]))
        self.model.train()


def one_graph(model):
    return [load_data()] * EPOCHS


@pytest.mark.parametrize("check", checks())
def test_full_batch_gcn_with_sparse_adjacency_built_once(check):
    compare(make_gcn, gcn_hand, GCNTrainer, one_graph, check, steps=EPOCHS,
            optimizer=partial(torch.optim.Adam, lr=LR, weight_decay=WEIGHT_DECAY))
