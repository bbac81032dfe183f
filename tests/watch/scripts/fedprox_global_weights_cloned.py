# FedProx as ki-ljl/FedProx-PyTorch writes it (fedprox_proximal_term.py), with the global weights of the proximal term
# taken from the client's own model right after the server dispatched its weights into it, by
# `[p.clone() for p in model.parameters()]` without `.detach()`: each clone keeps its graph back to its parameter, so
# `(w - w_t).norm(2)` gives `w` no gradient (the two paths cancel) and FedProx trains as FedAvg, while every local
# step back-propagates through the clones again. Stopped at step 3, naming `global_weights[i]`, with the fix to store
# them detached (the whole list).
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
    global_weights = [p.clone() for p in model.parameters()]
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
            for w, w_t in zip(model.parameters(), global_weights):
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
