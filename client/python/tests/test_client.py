"""starckpt.Client against a real cluster: round trips of every supported type, and errors."""

from __future__ import annotations

import collections
import json
import math
import os
import struct
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import starckpt

torch = pytest.importorskip("torch")

NUMPY_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
                np.float16, np.float32, np.float64, np.complex64, np.complex128, np.dtype(">i4"), np.dtype("<U3")]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


def client(cluster, job, **kwargs) -> starckpt.Client:
    return starckpt.Client(cluster.address, job, **kwargs)


def random_array(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    array = raw.view(dtype).reshape(shape)
    if array.dtype.kind == "b":
        array = raw[: array.size].reshape(shape) % 2 == 1
    if array.dtype.kind == "U":
        array = np.array(["ab", "c", "xyz"] * (array.size // 3 + 1))[: array.size].reshape(shape)
    return array


def random_tensor(dtype, shape, seed):
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        return (raw[: int(np.prod(shape))] % 2 == 1).reshape(shape)
    return raw.view(dtype).reshape(shape)


def same_tensor(a, b) -> bool:
    """Bitwise equality (NaN payloads included), dtype and shape."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def same_array(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_every_numpy_dtype_round_trips(cluster, job):
    c = client(cluster, job)
    state = {str(np.dtype(d)): random_array(d, (3, 5), i) for i, d in enumerate(NUMPY_DTYPES)}
    c.save(1, state).wait()
    loaded, metadata = c.load(1)
    assert metadata == {}
    assert list(loaded) == list(state)
    for key in state:
        assert same_array(loaded[key], state[key]), key


def test_every_torch_dtype_round_trips_with_shapes_and_strides(cluster, job):
    c = client(cluster, job)
    state = {}
    for i, dtype in enumerate(TORCH_DTYPES):
        name = str(dtype).removeprefix("torch.")
        state[name] = random_tensor(dtype, (4, 6), i)
        state[f"{name}-empty"] = torch.empty((0, 7), dtype=dtype)
        state[f"{name}-0d"] = random_tensor(dtype, (), 100 + i)
        state[f"{name}-transposed"] = random_tensor(dtype, (5, 3), 200 + i).t()
        state[f"{name}-strided"] = random_tensor(dtype, (8, 9), 300 + i)[::2, 1::3]
    assert not state["float32-transposed"].is_contiguous() and not state["bfloat16-strided"].is_contiguous()
    c.save(2, state).wait()
    loaded, _ = c.load(2)
    assert list(loaded) == list(state)
    for key, tensor in state.items():
        assert same_tensor(loaded[key], tensor), key
        assert loaded[key].device.type == "cpu"


def test_nested_structures_and_plain_values_round_trip(cluster, job):
    c = client(cluster, job)
    weight = torch.nn.Parameter(torch.randn(3, 3))
    state = {
        "model": collections.OrderedDict([("layer.weight", weight), ("layer.bias", torch.zeros(3))]),
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.ones(3, 3)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "amsgrad": False}]},
        "floats": [math.nan, math.inf, -math.inf, -0.0, 1 / 3, 5e-324],
        "ints": [0, -1, 2**63, -(2**100)],
        "text": "ünïcode ✓", "none": None, "flags": (True, False),
        "blob": b"\x00\x01binary", "mutable": bytearray(b"abc"), "empty": {}, "empty_list": [], "empty_bytes": b"",
        (1, "tuple-key"): "value", 3: "int key", 2.5: "float key", None: "none key", np.float64(0.5): "numpy float key",
        "np_scalar": np.float32(1.5), "np_int": np.int64(-3),
        "rng": {"python": __import__("random").Random(5).getstate(), "numpy": np.random.RandomState(3).get_state()},
        "deep": [[[[{"x": [np.arange(3)]}]]]],
        "nan_payload": struct.unpack("<d", bytes.fromhex("0100000000f8ffff"))[0],  # a negative NaN with a payload
        "huge_int": 7 ** 20000,  # more digits than int(str) allows
        "np_bytes": np.bytes_(b"ab\x00c"),
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "versioned": torch.nn.BatchNorm1d(2).state_dict(),
    }
    c.save(3, state, metadata={"loss": 0.25, "tokens": 10**12, "tags": ["a", "b"]}).wait()
    loaded, metadata = c.load()
    assert metadata == {"loss": 0.25, "tokens": 10**12, "tags": ["a", "b"]}
    assert type(loaded["model"]) is collections.OrderedDict
    assert isinstance(loaded["model"]["layer.weight"], torch.nn.Parameter) and loaded["model"]["layer.weight"].requires_grad
    assert torch.equal(loaded["model"]["layer.weight"].detach(), weight.detach())
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.ones(3, 3))
    floats = loaded["floats"]
    assert math.isnan(floats[0]) and floats[1:3] == [math.inf, -math.inf]
    assert math.copysign(1, floats[3]) == -1 and floats[4:] == state["floats"][4:]
    for key in ["ints", "text", "none", "flags", "blob", "empty", "empty_list", "empty_bytes", (1, "tuple-key"), 3, 2.5, None]:
        assert loaded[key] == state[key] and type(loaded[key]) is type(state[key]), key
    assert type(loaded["mutable"]) is bytearray and loaded["mutable"] == b"abc"
    assert type(loaded["np_scalar"]) is np.float32 and loaded["np_scalar"] == 1.5
    assert type(loaded["np_int"]) is np.int64 and loaded["np_int"] == -3
    assert loaded["rng"]["python"] == state["rng"]["python"]
    numpy_rng = np.random.RandomState()
    numpy_rng.set_state(loaded["rng"]["numpy"])
    assert numpy_rng.randint(1 << 30) == np.random.RandomState(3).randint(1 << 30)
    assert same_array(loaded["deep"][0][0][0][0]["x"][0], np.arange(3))
    assert struct.pack("<d", loaded["nan_payload"]) == bytes.fromhex("0100000000f8ffff")
    assert loaded["huge_int"] == 7 ** 20000
    assert type(loaded["np_bytes"]) is np.bytes_ and loaded["np_bytes"] == np.bytes_(b"ab\x00c")
    assert torch.equal(loaded["conj"], torch.tensor([1 - 2j, 3 + 4j]))
    assert loaded["versioned"]._metadata == state["versioned"]._metadata  # module versions kept
    torch.nn.BatchNorm1d(2).load_state_dict(loaded["versioned"])


def test_tied_tensors_are_stored_once_and_stay_tied(cluster, job):
    c = client(cluster, job)
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
    head.weight = embed.weight  # tied: state_dict() lists it under both names
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    array = np.arange(12.0)
    state = {"model": model.state_dict(), "a": array, "again": array, "strided": array[::2]}
    c.save(1, state).wait()
    data_files = [path for path, _ in c.manifest(1).files() if path.startswith("data/")]
    assert len(data_files) == 3, data_files  # the weight once, the array once, its strided view
    loaded, _ = c.load(1)
    assert loaded["model"]["embed.weight"] is loaded["model"]["head.weight"]
    assert torch.equal(loaded["model"]["head.weight"], embed.weight.detach())
    assert loaded["a"] is loaded["again"] and loaded["strided"] is not loaded["a"]
    assert same_array(loaded["strided"], array[::2]) and same_array(loaded["a"], array)
    restored = torch.nn.ModuleDict({"embed": torch.nn.Embedding(16, 8), "head": torch.nn.Linear(8, 16, bias=False)})
    restored.load_state_dict(loaded["model"])
    assert torch.equal(restored["head"].weight, embed.weight)


def test_saving_and_loading_leave_tensors_resizable(cluster, job):
    c = client(cluster, job)
    saved = torch.arange(10.0)
    c.save(2, {"t": saved}).wait()
    saved.resize_(20)  # Tensor.numpy() would have fixed its storage's size for good
    loaded, _ = c.load(2)
    assert torch.equal(loaded["t"], torch.arange(10.0))
    loaded["t"].resize_(30)


def test_a_malformed_tree_is_a_format_error_before_anything_is_allocated():
    from starckpt import _state

    def document(root):
        return json.dumps({"format": 1, "root": root}).encode()

    cases = [
        ({"t": "bytes", "f": "x", "n": 1 << 60}, {"x": 10}),  # a petabyte bytearray
        ({"t": "ndarray", "dtype": "<f4", "shape": [1 << 40, 1 << 20], "f": "x"}, {"x": 10}),
        ({"t": "tensor", "dtype": "float32", "shape": [1 << 40], "f": "x"}, {"x": 4}),
        ({"t": "ndarray", "dtype": "<f4", "shape": [-1], "f": "x"}, {"x": 4}),
        ({"t": "ndarray", "dtype": "O", "shape": [1], "f": "x"}, {"x": 8}),
        ({"t": "ndarray", "shape": [1], "f": "x"}, {"x": 4}),  # no dtype
        ({"t": "tensor", "dtype": "Tensor", "shape": [1], "f": "x"}, {"x": 4}),
        ({"t": "int", "v": 5}, {}),
        ({"t": "float", "v": "zz"}, {}),
        ({"t": "str", "v": 5}, {}),
        ({"t": "ref", "f": "nowhere"}, {}),
        ({"t": "dict", "k": [{"t": "none"}], "v": []}, {}),
        ({"t": "list", "v": "abc"}, {}),
        ({"t": "odict", "k": [], "v": [], "m": "x"}, {}),
        ({"t": "float", "v": "00"}, {}),  # too short for a double
        ({"t": "ndarray", "dtype": "<f4", "shape": [0, 1 << 70], "f": "x"}, {"x": 0}),  # no bytes, too many elements
        ({"t": "dict", "k": [{"t": "list", "v": []}], "v": [{"t": "none"}]}, {}),  # an unhashable key
        ("leaf", {}),
    ]
    for root, sizes in cases:
        with pytest.raises(starckpt.FormatError):
            _state.plan_load(document(root), sizes, "here")
    # A reference comes back as the object it refers to.
    root = {"t": "list", "v": [{"t": "ndarray", "dtype": "<i2", "shape": [2], "f": "x"}, {"t": "ref", "f": "x"}]}
    leaves, build = _state.plan_load(document(root), {"x": 4}, "here")
    assert [leaf.path for leaf in leaves] == ["x"]
    first, second = build()
    assert first is second and first.dtype == np.int16


WORLD_SIZE_SCRIPT = """
import json, numpy as np, starckpt
ranks = [starckpt.Client(rank=r, world_size=2) for r in range(2)]
for r, c in enumerate(ranks):
    c.save(4, {"w": np.full(3, r)}).wait()
refused = []
for rank, world_size in ((0, 1), (3, 4)):
    try:
        starckpt.Client(rank=rank, world_size=world_size).load()
    except starckpt.InvalidInputError as e:
        refused.append(str(e))
print(json.dumps({"rank1": ranks[1].load()[0]["w"].tolist(), "refused": refused}))
"""


def test_a_checkpoint_of_several_ranks_loads_only_at_its_world_size(cluster, job):
    from conftest import python_env, run_python

    env = python_env(cluster, STARCKPT_JOB=job, STARCKPT_RUN_ID=f"run-{job}")
    out = json.loads(run_python(["-c", WORLD_SIZE_SCRIPT], env).stdout)
    assert out["rank1"] == [1, 1, 1]
    assert len(out["refused"]) == 2 and all("saved by 2 ranks" in e for e in out["refused"]), out


def test_save_returns_after_staging_and_the_caller_may_reuse_its_memory(cluster, job):
    c = client(cluster, job)
    big = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB: several chunks
    expected = big.clone()
    handle = c.save(4, {"big": big})
    assert handle.staged()
    big.fill_(-1)  # the trainer's next optimizer step
    outcome = handle.wait()
    assert outcome.committed and outcome.step == 4 and outcome.total_bytes >= expected.numel() * 4
    assert handle.done() and handle.progress["done_bytes"] == handle.progress["total_bytes"]
    assert handle.wait() == outcome  # waiting again gives the same outcome
    loaded, _ = c.load(4)
    assert torch.equal(loaded["big"], expected)
    assert c.latest() == 4


def test_an_unchanged_tensor_is_deduplicated_and_listed_bytes_add_up(cluster, job):
    c = client(cluster, job)
    frozen = torch.randn(1 << 20)
    c.save(1, {"frozen": frozen, "moving": torch.randn(1 << 20)}).wait()
    second = c.save(2, {"frozen": frozen, "moving": torch.randn(1 << 20)}).wait()
    assert second.deduplicated_chunks >= 1
    listed = {cp["step"]: cp for cp in c.list()}
    assert set(listed) == {1, 2} and all(cp["state"] == "committed" for cp in listed.values())
    assert listed[2]["written_bytes"] < listed[2]["total_bytes"]


def test_compressed_saves_shrink_bf16_weights_and_restore_exactly(cluster, job):
    c = client(cluster, job, compress=1)
    weights = (torch.randn(3 << 20) * 0.02).to(torch.bfloat16)
    noise = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int32)
    handle = c.save(1, {"w": weights, "noise": noise})
    outcome = handle.wait()
    progress = handle.progress
    assert progress["uploaded_bytes"] == outcome.uploaded_bytes
    assert progress["stored_bytes"] < outcome.uploaded_bytes - weights.numel() * 2 // 5
    loaded, _ = client(cluster, job).load(1)
    assert torch.equal(loaded["w"], weights) and torch.equal(loaded["noise"], noise)

    # The codec functions: what a save sends for one chunk, and back.
    chunk = weights[: 1 << 21].view(torch.uint8).numpy().tobytes()
    codec, packed = starckpt.compress_chunk(chunk)
    assert codec.startswith("zstd-planes") and len(packed) < len(chunk) * 0.8
    assert starckpt.decompress_chunk(codec, packed, len(chunk)) == chunk
    assert starckpt.compress_chunk(noise.numpy().tobytes()) is None
    with pytest.raises(starckpt.InvalidInputError):
        starckpt.decompress_chunk(codec, packed[:-3], len(chunk))
    with pytest.raises(starckpt.InvalidInputError):
        client(cluster, job, compress=99)


def test_gil_is_released_while_saving_and_loading(cluster, job):
    """With a 60 s switch interval, a Python thread only runs while the main thread blocks
    outside the interpreter (the GIL released): it must tick during the save and the load."""
    c = client(cluster, job)
    state = {f"t{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            time.sleep(0.0005)  # gives the GIL back at once
            ticks += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(60)
    thread = threading.Thread(target=count)
    try:
        thread.start()
        before = ticks
        c.save(1, state, blocking=True)
        during_save = ticks - before
        before = ticks
        c.load(1)
        during_load = ticks - before
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert during_save > 5 and during_load > 5, (during_save, during_load)


RANK_SCRIPT = """
import json, sys, torch, starckpt
c = starckpt.Client()  # server, job, rank and world size from the environment
if sys.argv[1] == "save":
    outcome = c.save(10, {"rank": c.rank, "w": torch.full((4,), float(c.rank))}).wait()
    print(json.dumps({"committed": outcome.committed, "parts": outcome.parts_committed, "latest": c.latest()}))
else:
    state, _ = c.load()
    print(json.dumps({"rank": state["rank"], "w": state["w"].tolist()}))
"""


def test_multi_rank_saves_commit_only_when_every_rank_is_in(cluster, job):
    from conftest import python_env, run_python

    def rank(r, action):
        env = python_env(cluster, STARCKPT_JOB=job, STARCKPT_RUN_ID=f"run-{job}", RANK=str(r), WORLD_SIZE="2")
        return json.loads(run_python(["-c", RANK_SCRIPT, action], env).stdout)

    assert rank(0, "save") == {"committed": False, "parts": 1, "latest": None}
    assert rank(1, "save") == {"committed": True, "parts": None, "latest": 10}
    for r in range(2):
        assert rank(r, "load") == {"rank": r, "w": [float(r)] * 4}


SOLO_SCRIPT = """
import json, sys, warnings, numpy as np, starckpt
warnings.simplefilter("always")
ranks = [starckpt.Client(rank=r) for r in map(int, sys.argv[1:])]  # world size from WORLD_SIZE
seen = []
for step in (1, 2, 3):
    for c in ranks:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c.save(step, {"w": np.full(8, step, dtype=np.float32)}, blocking=True)
        seen += [f"{w.category.__name__}: {w.message}" for w in caught]
print(json.dumps({"warnings": seen, "latest": ranks[0].latest()}))
"""


def test_saving_from_rank_0_alone_of_several_warns_that_nothing_commits(cluster, job):
    from conftest import python_env, run_python

    def run(job, *ranks):
        env = python_env(cluster, STARCKPT_JOB=job, STARCKPT_RUN_ID=f"run-{job}", WORLD_SIZE="4")
        return json.loads(run_python(["-c", SOLO_SCRIPT, *map(str, ranks)], env).stdout)

    # The torchrun trap: WORLD_SIZE=4, and rank 0 alone saves. Warned once, at step 2.
    alone = run(job, 0)
    assert alone["latest"] is None
    assert len(alone["warnings"]) == 1, alone
    assert alone["warnings"][0].startswith("IncompleteCheckpointWarning: starckpt: step 1 ")
    assert "1 of 4 parts" in alone["warnings"][0] and "world_size=1" in alone["warnings"][0]
    # Every rank saving each step in turn: nothing to warn of.
    assert run(f"{job}-all", 0, 1, 2, 3) == {"warnings": [], "latest": 3}


def test_restore_writes_the_files(cluster, job, tmp_path):
    c = client(cluster, job)
    c.save(5, {"a": np.arange(10, dtype=np.int32), "b": b"hello"}).wait()
    out = c.restore(to=tmp_path / "restored")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert "_starckpt/tree.json" in files and len(files) == 3
    contents = {p.read_bytes() for p in out.rglob("data/*")}
    assert contents == {np.arange(10, dtype=np.int32).tobytes(), b"hello"}
    with pytest.raises(starckpt.InvalidInputError, match="not empty"):
        c.restore(to=out)


# -- errors -------------------------------------------------------------------------------------


def test_unknown_steps_and_jobs_raise_not_found(cluster, job):
    c = client(cluster, job)
    assert c.latest() is None
    with pytest.raises(starckpt.NotFoundError):
        c.load()
    c.save(1, {"x": 1}).wait()
    with pytest.raises(starckpt.NotFoundError, match="step 99"):
        c.load(99)
    with pytest.raises(LookupError):  # NotFoundError is a LookupError too
        c.load(98)


@pytest.mark.parametrize("bad", [
    {"masked": np.ma.masked_array([1, 2], mask=[0, 1])},
    {"void": np.zeros(2, dtype="V4")},
    {"meta": torch.empty(3, device="meta")},
    {"s": {1, 2}},
    {"obj": np.array([object()], dtype=object)},
    {"fn": len},
    {frozenset([1]): 1},
    {"sparse": torch.eye(3).to_sparse()},
])
def test_unsupported_values_are_refused_with_their_key_path(cluster, job, bad):
    c = client(cluster, job)
    with pytest.raises(starckpt.UnsupportedTypeError) as info:
        c.save(1, bad)
    assert isinstance(info.value, TypeError)
    assert c.latest() is None and c.list(include_inactive=True) == []


def test_bad_arguments_raise_invalid_input(cluster, job):
    c = client(cluster, job)
    for step in (-1, "3", 1.5, True):
        with pytest.raises(starckpt.InvalidInputError):
            c.save(step, {})
    with pytest.raises(starckpt.InvalidInputError, match="JSON"):
        c.save(1, {}, metadata={"x": object()})
    with pytest.raises(starckpt.InvalidInputError):
        starckpt.Client(cluster.address, "bad/job name").latest()
    with pytest.raises(starckpt.InvalidInputError, match="token"):
        starckpt.Client(cluster.address, job, token="secret")
    with pytest.raises(starckpt.InvalidInputError, match="no job"):
        starckpt.Client(cluster.address).latest()
    with pytest.raises(starckpt.InvalidInputError, match="rank"):
        starckpt.Client(cluster.address, job, rank=2, world_size=2)
    with pytest.raises(starckpt.InvalidInputError, match="run id"):
        starckpt.Client(cluster.address, job, rank=0, world_size=2).save(1, {})
    handle = c.save(1, {"x": torch.zeros(1)})
    with pytest.raises(starckpt.InvalidInputError, match="timeout"):
        handle.wait(timeout=-1)
    handle.wait()
    with pytest.raises(starckpt.AlreadyExistsError, match="step 1"):
        c.save(1, {"x": 2})


def test_bad_read_ranges_are_errors_not_aborts(cluster, job):
    c = client(cluster, job)
    c.save(1, {"x": b"0123456789"}).wait()
    manifest = c.manifest()
    path = next(p for p, size in manifest.files() if size == 10)
    assert manifest.read(path, 2, 3) == b"234"
    with pytest.raises(starckpt.InvalidInputError, match="outside"):
        manifest.read(path, 0, 1 << 62)
    with pytest.raises(starckpt.InvalidInputError, match="outside"):
        manifest.read(path, 8, 5)
    with pytest.raises(starckpt.NotFoundError):
        manifest.read("no/such/file", 0, 1 << 62)
    with pytest.raises(starckpt.InvalidInputError, match="writable"):
        manifest.read_many([(path, b"immutable!", 0)])
    target = np.zeros(10, dtype=np.uint8)
    with pytest.raises(starckpt.InvalidInputError, match="overlap"):
        manifest.read_many([(path, target[:6], 0), (path, target[4:], 0)])


def test_saves_still_in_flight_commit_when_the_interpreter_exits(cluster, job):
    from conftest import python_env, run_python

    code = "import starckpt, numpy as np; starckpt.Client().save(3, {'w': np.ones(1 << 22)})"
    run_python(["-c", code], python_env(cluster, STARCKPT_JOB=job))
    assert client(cluster, job).latest() == 3


def test_taking_the_lease_fences_the_previous_run_before_any_save(cluster, job):
    c = client(cluster, job)
    c.save(1, {"x": 1}).wait()
    code = "import starckpt; print(starckpt.Client().take_lease())"
    from conftest import python_env, run_python

    epoch = int(run_python(["-c", code], python_env(cluster, STARCKPT_JOB=job)).stdout)
    assert epoch > c.take_lease()  # this process keeps the epoch it took, now superseded
    with pytest.raises(starckpt.FencedError):
        c.save(2, {"x": 2})
    assert c.latest() == 1


def test_a_closed_client_refuses_calls_after_finishing_its_saves(cluster, job):
    c = client(cluster, job)
    handle = c.save(1, {"x": torch.randn(1 << 20)})
    c.close()
    assert handle.done() and handle.wait().committed
    for call in (c.latest, c.list, lambda: c.save(2, {}), c.load):
        with pytest.raises(starckpt.ClosedError):
            call()
    with client(cluster, job) as other:
        assert other.latest() == 1


def test_an_unreachable_server_raises_connection_error():
    with pytest.raises(starckpt.ConnectionError) as info:
        starckpt.Client("127.0.0.1:1", "job").latest()
    assert isinstance(info.value, ConnectionError)


def test_a_checkpoint_not_written_by_the_python_sdk_raises_format_error(cluster, job, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x" * 100)
    out = cluster.cli("save", "--job", job, "--step", "1", str(tmp_path / "weights.bin"))
    assert out.returncode == 0, out.stderr
    with pytest.raises(starckpt.FormatError, match="not written by starckpt.Client.save"):
        client(cluster, job).load()


def test_a_newer_run_fences_this_process(cluster, job):
    c = client(cluster, job)
    c.save(1, {"x": 1}).wait()
    code = f"import starckpt; starckpt.Client({cluster.address!r}, {job!r}).save(2, {{'x': 2}}, blocking=True)"
    subprocess.run([sys.executable, "-c", code], check=True, env={k: v for k, v in os.environ.items() if not k.startswith("STARCKPT_")})
    with pytest.raises(starckpt.FencedError):
        c.save(3, {"x": 3})
    assert c.latest() == 2


def test_a_save_that_failed_in_the_background_is_raised_not_lost(tmp_path, job):
    """A trainer that saves without waiting is told when a save failed after it returned: by its
    next save (before anything is saved) or by close, once, with the failed step named."""
    from conftest import Cluster

    for then in ("save", "close"):
        (tmp_path / then).mkdir()
        lone = Cluster(tmp_path / then, targets=1)
        try:
            c = client(lone, job)
            c.save(1, {"w": np.ones(1 << 20, np.uint8)}).wait()
            lone.targets[0].kill()
            # The control plane still lists the dead target alive for a moment: the save begins
            # and stages, and its upload fails in the background.
            failed = c.save(2, {"w": np.full(1 << 20, 2, np.uint8)})
            while not failed.done():
                time.sleep(0.05)
            with pytest.raises(starckpt.StarckptError) as raised:
                c.save(3, {"x": 1}) if then == "save" else c.close()
            if then == "save":
                assert any("the save of step 2 failed in the background" in n for n in raised.value.__notes__)
            c.close()  # raised once: not again
        finally:
            lone.stop()


def test_wait_times_out_while_the_cluster_is_stopped_then_commits(tmp_path, job):
    from conftest import Cluster

    cluster = Cluster(tmp_path)
    try:
        c = client(cluster, job)
        stopped = [cluster.server, *cluster.targets]
        for attempt in range(5):
            handle = c.save(attempt, {"big": torch.randn(16 << 20)})  # 64 MiB
            for proc in stopped:
                proc.signal(signal.SIGSTOP)
            try:
                if handle.done():
                    continue  # finished before the stop: try again
                with pytest.raises(TimeoutError, match="not committed within"):
                    handle.wait(timeout=0.3)
                assert not handle.done()
            finally:
                for proc in stopped:
                    proc.signal(signal.SIGCONT)
            assert handle.wait(timeout=60).committed
            break
        else:
            pytest.fail("every save committed before the cluster could be stopped")

        # A signal handler that calls starckpt while a call waits on this thread gets an error
        # (rather than a deadlock behind the call it interrupted).
        def handler(signum, frame):
            c.list()

        previous = signal.signal(signal.SIGALRM, handler)
        cluster.server.signal(signal.SIGSTOP)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(starckpt.StarckptError, match="in progress on this thread"):
                c.latest()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            cluster.server.signal(signal.SIGCONT)
        assert c.latest() == attempt
    finally:
        cluster.stop()


# -- staging by fill functions (the device-to-host path) ---------------------------------------


def test_tensors_staged_by_fill_functions_round_trip(cluster, job, monkeypatch):
    """Accelerator tensors are copied by torch straight into staging buffers through fill
    functions; routing CPU tensors the same way tests that path here, without a GPU."""
    from starckpt import _state

    monkeypatch.setattr(_state, "FILL_DEVICE_TYPES", {"cpu"})
    c = client(cluster, job)
    state = {
        "big": random_tensor(torch.bfloat16, (3, 5 << 20), 1),  # 30 MiB: several staging buffers
        "strided": random_tensor(torch.float32, (64, 96), 2)[::3, 5::2],
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    assert isinstance(_state.tensor_source(state["big"], "big"), tuple)
    handle = c.save(1, state)
    assert handle.progress["copied_bytes"] == handle.progress["total_bytes"]
    assert handle.wait().committed
    loaded, _ = c.load(1)
    for key, tensor in state.items():
        assert same_tensor(loaded[key], tensor), key


def test_a_failing_fill_fails_the_save_with_its_own_exception(cluster, job):
    c = client(cluster, job)
    native = c._client()

    def boom(offset, view):
        raise KeyError(f"no bytes at {offset}")

    with pytest.raises(KeyError, match="no bytes at 0"):
        native.save(job, 1, [("a", (10, boom))])
    kept = []

    def keeps_an_array_on_its_view(offset, view):
        kept.append(np.frombuffer(view, dtype=np.uint8))

    def keeps_a_tensor_on_its_view(offset, view):
        # torch.frombuffer ends its export at once and keeps the object instead.
        kept.append(torch.frombuffer(view, dtype=torch.uint8))

    def keeps_the_view(offset, view):
        kept.append(view)

    with pytest.raises(starckpt.InvalidInputError, match="kept 1 export"):
        native.save(job, 2, [("b", (10, keeps_an_array_on_its_view))])
    with pytest.raises(starckpt.InvalidInputError, match="kept 1 reference"):
        native.save(job, 2, [("b", (10, keeps_a_tensor_on_its_view))])
    with pytest.raises(starckpt.InvalidInputError, match="kept 1 reference"):
        native.save(job, 2, [("b", (10, keeps_the_view))])
    with pytest.raises(BufferError, match="handed back"):  # and the view itself reaches nothing
        memoryview(kept[-1])

    def copies_and_lets_go(offset, view):
        target = torch.frombuffer(view, dtype=torch.uint8)
        target.copy_(torch.arange(offset, offset + len(view), dtype=torch.uint8))
        del target

    native.save(job, 2, [("b", (10, copies_and_lets_go))]).wait()
    with pytest.raises(starckpt.InvalidInputError, match="neither a buffer nor"):
        native.save(job, 3, [("c", "not bytes")])
    assert c.latest() == 2  # only the save whose fill behaved committed


def test_a_compressing_client_in_the_same_process_writes_as_the_same_run(cluster, job):
    plain = client(cluster, job)
    packed = client(cluster, job, compress=1)
    assert plain._native is not packed._native and plain._native.run_id == packed._native.run_id
    plain.save(1, {"w": torch.randn(1000)}).wait()
    packed.save(2, {"w": torch.randn(1000)}).wait()
    plain.save(3, {"w": torch.randn(1000)}).wait()
    assert plain.latest() == 3


def test_warming_pre_faults_staging_memory_in_the_background(cluster, job):
    # The process's native client (and its staging pool) is shared: warm past what earlier tests
    # left allocated.
    start = client(cluster, job).staging_allocated_bytes
    c = client(cluster, job, warm=start + (8 << 20))
    deadline = time.monotonic() + 30
    while c.staging_allocated_bytes < start + (8 << 20):
        assert time.monotonic() < deadline, f"only {c.staging_allocated_bytes - start} bytes warmed"
        time.sleep(0.01)
    warmed = c.staging_allocated_bytes
    c.warm(4 << 20, wait=True)  # already there: nothing more allocated
    assert c.staging_allocated_bytes == warmed
    c.warm(warmed + (4 << 20), wait=True)
    assert c.staging_allocated_bytes >= warmed + (4 << 20)
    with pytest.raises(starckpt.InvalidInputError):
        c.warm(-1)
    c.save(1, {"w": np.ones(1 << 20, dtype=np.float32)}, blocking=True)
    assert c.latest() == 1


def test_a_child_forked_after_a_restore_restores_too(cluster, job):
    """A child forked after its parent read a checkpoint (the parent's runtime, shared memory and
    4 MiB chunks verified in place), and while the parent uploads another, reads it with a client
    of its own and drops the parent's objects, without hanging."""
    import gc

    state = {"w": random_array(np.uint8, (6 << 20,), 7)}
    c = client(cluster, job)
    c.save(1, state).wait()
    loaded, _ = c.load(1)
    assert same_array(loaded["w"], state["w"])
    uploading = c.save(2, {"w": random_array(np.uint8, (48 << 20,), 8)})
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            restored, _ = client(cluster, job).load(1)
            code = 0 if same_array(restored["w"], state["w"]) else 2
            # The parent's client and save handle, dropped here (not used: they refuse).
            del c, uploading
            gc.collect()
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                pytest.fail("the forked child hung")
            time.sleep(0.05)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0
        uploading.wait()
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_tenants_token_reaches_its_own_jobs_alone(tmp_path, monkeypatch):
    from conftest import Cluster, starckpt_bin

    tokens = tmp_path / "tokens"

    def new_token(*args: str) -> str:
        made = subprocess.run([starckpt_bin(), "token", "new", *args, "--tokens-file", str(tokens)],
                              capture_output=True, check=True)
        return made.stdout.decode().strip()

    admin, acme, beta = new_token("--admin"), new_token("--tenant", "acme"), new_token("--tenant", "beta")
    (tmp_path / "cluster").mkdir()
    tenants = Cluster(tmp_path / "cluster", targets=1, tokens_file=tokens, admin_token=admin)
    try:
        ours = starckpt.Client(tenants.address, "llama", token=acme)
        ours.save(1, {"w": np.arange(1000, dtype=np.float32)}).wait()
        # The same job name in another tenant is another job; the environment's token works too.
        monkeypatch.setenv("STARCKPT_TOKEN", beta)
        theirs = starckpt.Client(tenants.address, "llama")
        assert theirs.latest() is None
        theirs.save(5, {"w": np.zeros(3)}).wait()
        assert (ours.latest(), theirs.latest()) == (1, 5)
        state, _ = ours.load()
        assert same_array(state["w"], np.arange(1000, dtype=np.float32))
        # Without a token, or with one the control plane does not know: refused, as a PermissionError.
        monkeypatch.delenv("STARCKPT_TOKEN")
        (tmp_path / "acme.token").write_text(acme + "\n")
        monkeypatch.setenv("STARCKPT_TOKEN_FILE", str(tmp_path / "acme.token"))
        assert starckpt.Client(tenants.address, "llama").latest() == 1
        monkeypatch.delenv("STARCKPT_TOKEN_FILE")
        with pytest.raises(starckpt.DeniedError, match="bearer token"):
            starckpt.Client(tenants.address, "llama").latest()
        with pytest.raises(PermissionError):
            starckpt.Client(tenants.address, "llama", token="stk_" + "0" * 64).latest()
        listed = json.loads(tenants.cli("ls", "--json").stdout)
        assert sorted(j["job"] for j in listed) == ["acme/llama", "beta/llama"]
        # Deduplication never crosses tenants: beta's copy of acme's array is stored again, and
        # acme's second save of it deduplicates against acme's own.
        same = {"w": np.arange(1 << 20, dtype=np.float32)}
        first = starckpt.Client(tenants.address, "llama", token=acme).save(10, same).wait()
        assert first.deduplicated_chunks == 0
        theirs = starckpt.Client(tenants.address, "llama", token=beta).save(10, same).wait()
        assert (theirs.chunks, theirs.deduplicated_chunks) == (first.chunks, 0)
        again = starckpt.Client(tenants.address, "llama", token=acme).save(11, same).wait()
        assert again.deduplicated_chunks == first.chunks > 0
    finally:
        tenants.stop()


def test_a_save_while_the_previous_one_uploads_can_be_skipped(cluster, job):
    c = client(cluster, job)
    c.save(1, {"w": np.ones(8)}).wait()
    # Stopped targets hold the next save's upload (deterministically) after its staging copy.
    for target in cluster.targets:
        target.signal(signal.SIGSTOP)
    try:
        uploading = c.save(2, {"w": np.arange(1 << 20, dtype=np.float32)})
        # In a thread: a save that waited instead of skipping would wait for the stopped targets.
        skipped = []
        attempt = threading.Thread(target=lambda: skipped.append(c.save(3, {"w": np.zeros(4)}, skip_if_busy=True)))
        attempt.start()
        attempt.join(timeout=20)
        assert not attempt.is_alive(), "the save waited for the previous one"
        assert skipped == [None]
        assert not uploading.done()
    finally:
        for target in cluster.targets:
            target.signal(signal.SIGCONT)
    assert uploading.wait().committed
    assert c.latest() == 2
    assert c.save(4, {"w": np.zeros(4)}, skip_if_busy=True).wait().committed


def test_a_client_trusts_the_ca_of_a_control_plane_serving_tls(tmp_path, monkeypatch):
    from conftest import Cluster, tls_certificate

    (tmp_path / "certs").mkdir()
    ca, cert, key = tls_certificate(tmp_path / "certs")
    (tmp_path / "cluster").mkdir()
    tls = Cluster(tmp_path / "cluster", targets=1, tls=(ca, cert, key))
    monkeypatch.delenv("STARCKPT_TLS_CA", raising=False)
    try:
        weights = np.arange(1000, dtype=np.float32)
        starckpt.Client(tls.address, "tls", tls_ca=ca).save(1, {"w": weights}).wait()
        # The CA from the environment, and an https:// address with it.
        monkeypatch.setenv("STARCKPT_TLS_CA", str(ca))
        state, _ = starckpt.Client(tls.address, "tls").load()
        assert same_array(state["w"], weights)
        assert starckpt.Client(f"https://{tls.address}", "tls").latest() == 1
        # Without it the client dials in plaintext, and is told what is probably wrong.
        monkeypatch.delenv("STARCKPT_TLS_CA")
        with pytest.raises(starckpt.StarckptError, match="serve TLS"):
            starckpt.Client(tls.address, "tls").latest()
    finally:
        tls.stop()
