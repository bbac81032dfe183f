"""The tiny seeded model and data the repros share (as tests/lightning/common.py's)."""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def loader(n=14, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 6, generator=gen), torch.randn(n, 1, generator=gen)), batch_size=2)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def sgd(params, lr=0.05):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)
