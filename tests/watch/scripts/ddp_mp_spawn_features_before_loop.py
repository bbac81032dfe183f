# torch.multiprocessing.spawn's 2 ranks (gloo), each encoding its batch once before the loop and training the
# encoder and a DistributedDataParallel head on those features every step (seed 001's mistake, in each rank).
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
    encoder, head = nn.Linear(4, 4), DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    feat = encoder(x)
    try:
        for step in range(3):
            loss = nn.functional.mse_loss(head(feat), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        del head, opt  # the wrapper keeps the group's threads alive: gone before the group ends
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(2, os.path.join(tmp, "init")), nprocs=2)
