"""An unmodified torchrun-style DDP script: fixed data and seed; rank 0 prints the final weights' sum."""

import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
    per = 64 // world
    for _ in range(20):
        opt.zero_grad()
        loss = ((model(x[rank * per : (rank + 1) * per]) - y[rank * per : (rank + 1) * per]) ** 2).mean()
        loss.backward()
        opt.step()
    if rank == 0:
        with open(os.environ["DDP_OUT"], "w") as fh:
            fh.write(repr([float(p.detach().double().sum()) for p in model.parameters()]))
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
