"""Run by test_torch.py under torchrun (2 ranks, gloo): saves or loads a DCP state holding a
tensor sharded across the ranks (DTensor), a replicated tensor, a per-rank tensor and a plain
value through starckpt, and prints what it saw as JSON (rank 0)."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import starckpt.torch as st

FULL = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6).to(torch.bfloat16)


def main() -> None:
    action, job, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if action == "save":
        state = {
            "sharded": distribute_tensor(FULL, mesh, [Shard(0)]),
            "replicated": torch.linspace(0, 1, 10),
            f"rank/{rank}": torch.full((3,), float(rank)),
            "epoch": 7,
        }
        dcp.save(state, storage_writer=st.Writer(job=job, step=step))
        result = {"saved": step}
    else:
        state = {
            "sharded": distribute_tensor(torch.zeros_like(FULL), mesh, [Shard(0)]),
            "replicated": torch.zeros(10),
            f"rank/{rank}": torch.zeros(3),
            "epoch": 0,
        }
        dcp.load(state, storage_reader=st.Reader(job=job))
        full = state["sharded"].full_tensor()
        ok = (torch.equal(full, FULL) and torch.equal(state["replicated"], torch.linspace(0, 1, 10))
              and torch.equal(state[f"rank/{rank}"], torch.full((3,), float(rank))) and state["epoch"] == 7)
        oks = [None] * world
        dist.all_gather_object(oks, ok)
        result = {"loaded": all(oks)}
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's threads occasionally abort it ("terminate called without
    # an active exception") after everything this script checks is done.
    os._exit(0)


if __name__ == "__main__":
    main()
