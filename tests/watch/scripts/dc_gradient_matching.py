# Trimmed from VICO-UoE/DatasetCondensation, main.py (the "Train synthetic data" loop) and utils.py (`match_loss`,
# `distance_wb`, `epoch`): dataset condensation with gradient matching. Each iteration draws a new network and its
# optimizer; each outer step matches, class by class, the network's gradient on real images (taken without a graph,
# detached and cloned) with its gradient on the synthetic images (`create_graph=True`), steps `optimizer_img` on the
# synthetic images, then trains the network on `copy.deepcopy(image_syn.detach())` through a DataLoader.
import copy

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)
np.random.seed(0)
num_classes, ipc, channel, im_size = 2, 2, 1, (6, 6)
Iteration, outer_loop, inner_loop, batch_real = 3, 2, 1, 4

images_all = torch.randn(16, channel, *im_size)
labels_all = torch.tensor([i % num_classes for i in range(16)])
indices_class = [[i for i, lab in enumerate(labels_all.tolist()) if lab == c] for c in range(num_classes)]


def get_images(c, n):  # get random n images from class c
    idx_shuffle = np.random.permutation(indices_class[c])[:n]
    return images_all[idx_shuffle]


class TensorDataset(Dataset):
    def __init__(self, images, labels):
        self.images = images.detach().float()
        self.labels = labels.detach()

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __len__(self):
        return self.images.shape[0]


def get_network():
    return nn.Sequential(nn.Conv2d(channel, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 9, num_classes))


def distance_wb(gwr, gws):
    shape = gwr.shape
    if len(shape) == 4:  # conv, out*in*h*w
        gwr = gwr.reshape(shape[0], shape[1] * shape[2] * shape[3])
        gws = gws.reshape(shape[0], shape[1] * shape[2] * shape[3])
    elif len(shape) == 1:  # bias
        return torch.tensor(0, dtype=torch.float)
    return torch.sum(1 - torch.sum(gwr * gws, dim=-1) / (torch.norm(gwr, dim=-1) * torch.norm(gws, dim=-1) + 0.000001))


def match_loss(gw_syn, gw_real):
    dis = torch.tensor(0.0)
    for ig in range(len(gw_real)):
        dis += distance_wb(gw_real[ig], gw_syn[ig])
    return dis


def epoch(dataloader, net, optimizer, criterion):
    loss_avg, num_exp = 0, 0
    net.train()
    for datum in dataloader:
        img, lab = datum[0].float(), datum[1].long()
        output = net(img)
        loss = criterion(output, lab)
        loss_avg += loss.item() * lab.shape[0]
        num_exp += lab.shape[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss_avg / num_exp


image_syn = torch.randn(size=(num_classes * ipc, channel, *im_size), dtype=torch.float, requires_grad=True)
label_syn = torch.tensor(np.array([np.ones(ipc) * i for i in range(num_classes)]), dtype=torch.long).view(-1)
for c in range(num_classes):
    image_syn.data[c * ipc:(c + 1) * ipc] = get_images(c, ipc).detach().data
optimizer_img = torch.optim.SGD([image_syn, ], lr=0.1, momentum=0.5)
optimizer_img.zero_grad()
criterion = nn.CrossEntropyLoss()

for it in range(Iteration + 1):
    net = get_network()
    net.train()
    net_parameters = list(net.parameters())
    optimizer_net = torch.optim.SGD(net.parameters(), lr=0.01)
    optimizer_net.zero_grad()
    loss_avg = 0
    for ol in range(outer_loop):
        loss = torch.tensor(0.0)
        for c in range(num_classes):
            img_real = get_images(c, batch_real)
            lab_real = torch.ones((img_real.shape[0],), dtype=torch.long) * c
            img_syn = image_syn[c * ipc:(c + 1) * ipc].reshape((ipc, channel, im_size[0], im_size[1]))
            lab_syn = torch.ones((ipc,), dtype=torch.long) * c

            output_real = net(img_real)
            loss_real = criterion(output_real, lab_real)
            gw_real = torch.autograd.grad(loss_real, net_parameters)
            gw_real = list((_.detach().clone() for _ in gw_real))

            output_syn = net(img_syn)
            loss_syn = criterion(output_syn, lab_syn)
            gw_syn = torch.autograd.grad(loss_syn, net_parameters, create_graph=True)

            loss += match_loss(gw_syn, gw_real)

        optimizer_img.zero_grad()
        loss.backward()
        optimizer_img.step()
        loss_avg += loss.item()

        if ol == outer_loop - 1:
            break

        image_syn_train, label_syn_train = copy.deepcopy(image_syn.detach()), copy.deepcopy(label_syn.detach())
        dst_syn_train = TensorDataset(image_syn_train, label_syn_train)
        trainloader = DataLoader(dst_syn_train, batch_size=2, shuffle=True, num_workers=0)
        for il in range(inner_loop):
            train_loss = epoch(trainloader, net, optimizer_net, criterion)
        print(f"iter {it} outer {ol} net loss {train_loss!r}")

    loss_avg /= (num_classes * outer_loop)
    print(f"iter {it} loss {loss_avg!r}")
print("image_syn", image_syn.detach().sum().item(), image_syn.detach().pow(2).sum().item())
