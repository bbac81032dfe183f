# Federated averaging after shaoxiongji/federated-learning's main_fed.py: each round every client trains a
# copy.deepcopy of the global model with an SGD made for it (LocalUpdate.train, local epochs), and the global model
# loads the average of the clients' state_dicts (FedAvg). Many optimizers, each stepping for a few steps only. Correct.
import copy
import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
net_glob = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
dict_users = {idx: [(torch.randn(8, 10), torch.randint(0, 3, (8,))) for _ in range(2)] for idx in range(3)}


def local_train(net, batches, local_ep=2):
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    epoch_loss = []
    for _ in range(local_ep):
        batch_loss = []
        for images, labels in batches:
            net.zero_grad()
            loss = F.cross_entropy(net(images), labels)
            loss.backward()
            optimizer.step()
            batch_loss.append(loss.item())
        epoch_loss.append(sum(batch_loss) / len(batch_loss))
    return net.state_dict(), sum(epoch_loss) / len(epoch_loss)


def fed_avg(w):
    w_avg = copy.deepcopy(w[0])
    for k in w_avg.keys():
        for i in range(1, len(w)):
            w_avg[k] += w[i][k]
        w_avg[k] = torch.div(w_avg[k], len(w))
    return w_avg


for rnd in range(3):
    w_locals, loss_locals = [], []
    for idx in range(3):
        w, loss = local_train(copy.deepcopy(net_glob), dict_users[idx])
        w_locals.append(copy.deepcopy(w))
        loss_locals.append(copy.deepcopy(loss))
    net_glob.load_state_dict(fed_avg(w_locals))
    print(f"round {rnd}: average loss {sum(loss_locals) / len(loss_locals):.6f}")
print(hashlib.sha1(b"".join(t.numpy().tobytes() for t in net_glob.state_dict().values())).hexdigest())
