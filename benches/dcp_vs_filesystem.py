#!/usr/bin/env python3
"""DCP's FileSystemWriter to local disk against starckpt.torch.Writer, side by side in one run.

    python3 benches/dcp_vs_filesystem.py --size-mib 1024 --runs 3 [--server HOST:PORT] [--json]

The state is laid out like mixed-precision Adam training (bf16 weights, fp32 master weights and
two fp32 moments per parameter; tensors of a transformer layer's shapes) and saved with
``dcp.async_save`` and ``dcp.save`` by each writer. Reported per writer and mode, medians over
--runs: the time the trainer is blocked (until async_save returns / save returns; for async_save
that is DCP's default stager copying the state into fresh CPU memory), the time until
the checkpoint is durable (FileSystemWriter fsyncs its files; starckpt commits once every chunk
is on its target's disk), and throughput. A memcpy of the same bytes is the floor for blocking.

Without --server it starts `starckpt dev` (3 targets) from --bin on a free port, with its data in
a temporary directory on the same filesystem as the FileSystemWriter's, so both write one disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import starckpt
import starckpt.torch as st

REPO = Path(__file__).resolve().parents[1]


def adam_state(size_bytes: int, hidden: int) -> dict[str, torch.Tensor]:
    """bf16 weights + fp32 master + 2 fp32 moments (14 bytes per parameter), layer-shaped."""
    shapes = [(hidden, hidden)] * 4 + [(4 * hidden, hidden), (hidden, 4 * hidden)]
    state: dict[str, torch.Tensor] = {}
    total, layer = 0, 0
    while total < size_bytes:
        for index, shape in enumerate(shapes):
            name = f"layers.{layer}.w{index}"
            weight = torch.randn(shape)
            state[f"model.{name}"] = weight.to(torch.bfloat16)
            state[f"optim.master.{name}"] = weight
            state[f"optim.exp_avg.{name}"] = torch.randn(shape) * 1e-3
            state[f"optim.exp_avg_sq.{name}"] = torch.rand(shape) * 1e-6
            total += 14 * weight.numel()
        layer += 1
    return state


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def perturb(state) -> None:
    """Changes one value in every MiB of every tensor, so that no save deduplicates against an
    earlier one (starckpt would otherwise upload nothing the second time)."""
    for tensor in state.values():
        flat = tensor.view(-1)
        flat[:: max(1, (1 << 20) // tensor.element_size())] += 1


def memcpy_seconds(state) -> float:
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    for t in targets.values():
        t.zero_()  # touched memory, as a staging pool's is
    start = time.perf_counter()
    for key, value in state.items():
        targets[key].copy_(value)
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_dev(binary: str, data: Path) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([binary, "dev", "--data", str(data), "--listen", address, "--targets", "3"],
                            stdout=subprocess.DEVNULL, stderr=open(data.parent / "dev.log", "wb"))
    deadline = time.monotonic() + 30
    while True:
        try:
            starckpt.Client(address, "bench-probe").latest()
            return proc, address
        except starckpt.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"starckpt dev did not start; see {data.parent / 'dev.log'}")
            time.sleep(0.2)


def measure(save_async: bool, run) -> tuple[float, float]:
    """(blocking seconds, seconds until durable) of one save."""
    start = time.perf_counter()
    result = run()
    blocked = time.perf_counter() - start
    if save_async:
        result.result()
    return blocked, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server", default=os.environ.get("STARCKPT_SERVER"))
    parser.add_argument("--bin", default=str(REPO / "target" / "release" / "starckpt"))
    parser.add_argument("--dir", default=None, help="where FileSystemWriter writes (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))

    work = Path(tempfile.mkdtemp(prefix="starckpt-bench-", dir=args.dir))
    dev = None
    server = args.server
    if not server:
        dev, server = start_dev(args.bin, work / "cluster")
    try:
        state = adam_state(args.size_mib << 20, args.hidden)
        size = nbytes(state)
        job = f"bench-dcp-{os.getpid()}"
        floor = statistics.median(memcpy_seconds(state) for _ in range(args.runs))
        results = []
        step = 0
        modes = {"async_save": True, "save": False}
        for mode, save_async in modes.items():
            for writer_name in ("FileSystemWriter", "starckpt.Writer"):
                samples = []
                for run in range(args.runs):
                    step += 1
                    perturb(state)
                    if writer_name == "FileSystemWriter":
                        path = work / f"fs-{step}"
                        writer = dcp.FileSystemWriter(path, sync_files=True)
                    else:
                        writer = st.Writer(job=job, step=step, server=server)
                    call = dcp.async_save if save_async else dcp.save
                    samples.append(measure(save_async, lambda: call(state, storage_writer=writer)))
                    if writer_name == "FileSystemWriter":
                        shutil.rmtree(path)
                blocked = statistics.median(s[0] for s in samples)
                durable = statistics.median(s[1] for s in samples)
                results.append({
                    "writer": writer_name, "mode": mode,
                    "blocking_s": blocked, "durable_s": durable,
                    "blocking_vs_memcpy": blocked / floor, "durable_gb_s": size / durable / 1e9,
                })
        report = {"bytes": size, "tensors": len(state), "runs": args.runs, "memcpy_s": floor, "results": results}
        if args.json:
            print(json.dumps(report, indent=2))
            return
        print(f"state: {size / 2**30:.2f} GiB in {len(state)} tensors (bf16 weights, fp32 master + Adam moments); "
              f"medians of {args.runs} runs; memcpy of the same bytes: {floor:.3f} s")
        print(f"{'writer':<18} {'mode':<13} {'blocking s':>10} {'x memcpy':>9} {'durable s':>10} {'GB/s':>6}")
        for r in results:
            print(f"{r['writer']:<18} {r['mode']:<13} {r['blocking_s']:>10.3f} {r['blocking_vs_memcpy']:>9.2f} "
                  f"{r['durable_s']:>10.3f} {r['durable_gb_s']:>6.2f}")
        by = {(r["writer"], r["mode"]): r for r in results}
        for mode in modes:
            fs, sk = by[("FileSystemWriter", mode)], by[("starckpt.Writer", mode)]
            print(f"{mode}: starckpt durable in {sk['durable_s'] / fs['durable_s']:.2f}x FileSystemWriter's time, "
                  f"blocking {sk['blocking_s'] / fs['blocking_s']:.2f}x")
    finally:
        if dev is not None:
            dev.terminate()
            dev.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
