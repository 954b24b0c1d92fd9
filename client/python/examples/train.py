"""A small PyTorch trainer that checkpoints through starckpt with DCP async saves and resumes from
the latest complete checkpoint after being killed.

    python train.py --job mlp --steps 300 --save-every 10 --loss-log loss.jsonl
    torchrun --standalone --nproc-per-node 2 train.py --job mlp-ddp --steps 300 --loss-log loss.jsonl

Deterministic on CPU: each step's batch comes from a generator seeded by (step, rank), the
dropout masks from the global RNG, whose state (per rank) is saved with the model and the
optimizer. So after a SIGKILL at any moment, a restart resumes from `latest` and logs, step for
step, exactly the losses an uninterrupted run logs. Rank 0 appends one JSON line per step to
--log (`{"step", "loss"}`), and one per committed save (`{"saved"}`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import starckpt
import starckpt.torch as st


def model_and_optimizer(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(width, 1),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(64, 32, generator=generator)
    y = (x[:, :8].sum(dim=1, keepdim=True) * 0.5).sin() + 0.05 * torch.randn(64, 1, generator=generator)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default=os.environ.get("STARCKPT_JOB", "train-example"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--loss-log", default=None, help="append per-step JSON lines here (rank 0)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (to widen kill windows)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    checkpoint_group = None
    if distributed:
        dist.init_process_group("gloo")
        # async_save's collectives run in a background thread: give them their own group so they
        # never interleave with the training all-reduces.
        checkpoint_group = dist.new_group(backend="gloo")
    rank = dist.get_rank() if distributed else 0

    model, optimizer = model_and_optimizer(args.width)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None

    def emit(record: dict) -> None:
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()

    def state() -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # The RNG state differs per rank: one key per rank, so DCP keeps each (no dedup).
        return {"model": model_sd, "optim": optim_sd, f"rng/{rank}": torch.get_rng_state()}

    client = starckpt.Client(job=args.job, rank=0, world_size=1)
    # Take the job's writer lease before choosing the step to resume from: no writer of the
    # preempted run can commit after this, so `latest` stays the newest checkpoint. Rank 0
    # decides and tells the others, so every rank resumes from the same step.
    client.take_lease()
    decision = [client.latest() if rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(decision, src=0)
    start, latest = 0, decision[0]
    if latest is not None:
        restored = state()
        dcp.load(restored, storage_reader=st.Reader(job=args.job, step=latest))
        set_state_dict(model, optimizer, model_state_dict=restored["model"], optim_state_dict=restored["optim"])
        torch.set_rng_state(restored[f"rng/{rank}"])
        start = latest + 1
        emit({"resumed_from": latest})

    in_flight: tuple[int, object] | None = None

    def finish_save() -> None:
        nonlocal in_flight
        if in_flight is not None:
            saved_step, future = in_flight
            future.result()
            emit({"saved": saved_step})
            in_flight = None

    for step in range(start, args.steps):
        model.train()
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        emit({"step": step, "loss": loss.item()})
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if (step + 1) % args.save_every == 0:
            finish_save()  # one save in flight at a time
            writer = st.Writer(job=args.job, step=step)
            in_flight = (step, dcp.async_save(state(), storage_writer=writer, process_group=checkpoint_group))
    finish_save()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
