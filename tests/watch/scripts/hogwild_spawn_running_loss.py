# pytorch/examples mnist_hogwild: one model in shared memory, trained by a process started by the spawn method
# (the default where fork is not: macOS, Windows, CUDA). It keeps `total` as the sum of its losses, with their
# graphs (meant: `total + loss.item()`).
import torch
import torch.multiprocessing as mp
from torch import nn


def train(rank, model):
    torch.manual_seed(1 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = 0.0
    for _ in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = total + loss
    print(f"rank {rank}: mean loss {total.item() / 4:.6f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model.share_memory()
    worker = mp.get_context("spawn").Process(target=train, args=(0, model))
    worker.start()
    worker.join()
    print(f"exit code {worker.exitcode}, weight sum {model.weight.sum().item():.6f}")
