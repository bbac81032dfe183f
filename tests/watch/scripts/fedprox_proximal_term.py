# FedProx as ki-ljl/FedProx-PyTorch writes it (server.py, client.py, model.py), shrunk: the server dispatches its
# weights to the sampled clients through `.data` (`old_params.data = new_params.data.clone()`); each client trains
# with its own Adam and StepLR, its loss adding the proximal term `(w - w_t).norm(2)` against
# `global_model = copy.deepcopy(server)` (whose parameters require grad: each backward also fills their gradients,
# which nothing reads); the server then averages the clients' parameters, weighted by their data, through `.data`.
# Correct.
import copy
import random

import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR


class ANN(nn.Module):
    def __init__(self, input_dim, name):
        super(ANN, self).__init__()
        self.name = name
        self.len = 0
        self.fc1 = nn.Linear(input_dim, 8)
        self.sigmoid = nn.Sigmoid()
        self.fc2 = nn.Linear(8, 8)
        self.fc4 = nn.Linear(8, 1)

    def forward(self, data):
        x = self.sigmoid(self.fc1(data))
        x = self.sigmoid(self.fc2(x))
        return self.sigmoid(self.fc4(x))


def train(mu, model, server, Dtr):
    model.train()
    model.len = len(Dtr)
    global_model = copy.deepcopy(server)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=1e-4)
    stepLR = StepLR(optimizer, step_size=1, gamma=0.5)
    loss_function = nn.MSELoss()
    for epoch in range(2):
        train_loss = []
        for (seq, label) in Dtr:
            y_pred = model(seq)
            optimizer.zero_grad()
            # compute proximal_term
            proximal_term = 0.0
            for w, w_t in zip(model.parameters(), global_model.parameters()):
                proximal_term += (w - w_t).norm(2)
            loss = loss_function(y_pred, label) + (mu / 2) * proximal_term
            train_loss.append(loss.item())
            loss.backward()
            optimizer.step()
        stepLR.step()
        print(model.name, epoch, repr(sum(train_loss) / len(train_loss)))
    return model


class FedProx:
    def __init__(self, K, C, r, mu, data):
        self.K, self.C, self.r, self.mu, self.data = K, C, r, mu, data
        self.nn = ANN(6, name='server')
        self.nns = []
        for i in range(K):
            temp = copy.deepcopy(self.nn)
            temp.name = f"client{i}"
            self.nns.append(temp)

    def server(self):
        for t in range(self.r):
            print('round', t + 1, ':')
            m = max(int(self.C * self.K), 1)
            index = random.sample(range(0, self.K), m)
            self.dispatch(index)
            self.client_update(index)
            self.aggregation(index)
        return self.nn

    def aggregation(self, index):
        s = 0
        for j in index:
            s += self.nns[j].len
        params = {}
        for k, v in self.nns[0].named_parameters():
            params[k] = torch.zeros_like(v.data)
        for j in index:
            for k, v in self.nns[j].named_parameters():
                params[k] += v.data * (self.nns[j].len / s)
        for k, v in self.nn.named_parameters():
            v.data = params[k].data.clone()

    def dispatch(self, index):
        for j in index:
            for old_params, new_params in zip(self.nns[j].parameters(), self.nn.parameters()):
                old_params.data = new_params.data.clone()

    def client_update(self, index):
        for k in index:
            self.nns[k] = train(self.mu, self.nns[k], self.nn, self.data[k])


random.seed(0)
torch.manual_seed(0)
data = [[(torch.randn(5, 6), torch.rand(5, 1)) for _ in range(2 + i % 2)] for i in range(4)]
fed = FedProx(K=4, C=0.5, r=3, mu=0.5, data=data)
server = fed.server()
print(repr(sum(p.detach().double().pow(2).sum().item() for p in server.parameters())))
