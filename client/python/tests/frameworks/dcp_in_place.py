"""DCP `dcp.save`/`dcp.load` with the stock FileSystemWriter on a path (torchtitan's way: the step
directory written in place, `.metadata` last), from WORLD ranks over gloo.

    python dcp_in_place.py PATH WORLD
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {f"w{rank}": torch.randn(512, 1024, generator=g), "shared": torch.arange(1000)}


def rank_main(rank: int, path: str, world: int, port: int) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    sd = state(rank)
    dcp.save(sd, checkpoint_id=path)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, checkpoint_id=path)
    assert all(torch.equal(back[k], sd[k]) for k in sd), rank
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    path, world = sys.argv[1], int(sys.argv[2])
    if world == 1:
        rank_main(0, path, 1, 0)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(path, world, port), nprocs=world)
    print("ok")


if __name__ == "__main__":
    main()
