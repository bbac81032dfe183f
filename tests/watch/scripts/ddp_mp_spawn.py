# PyTorch's DDP tutorial shape: torch.multiprocessing.spawn starts 2 ranks (gloo), each trains a
# DistributedDataParallel model on batches of its own; rank 0 prints the losses and the final weights.
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def run(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}")
    if rank == 0:
        print(f"weight sum {model.module.weight.sum().item():.6f}")
    del model, opt  # the wrapper keeps the group's threads alive: gone before the group ends
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(2, os.path.join(tmp, "init")), nprocs=2)
