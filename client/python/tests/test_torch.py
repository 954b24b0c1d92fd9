"""starckpt.torch against a real cluster: DCP save/load/async_save in one process and in two
(torchrun, gloo), loading with another world size, one-call save/load, and the example trainer
resuming after SIGKILL with the same losses as an uninterrupted run."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from conftest import EXAMPLES, python_env, run_python  # noqa: E402

import starckpt  # noqa: E402
import starckpt.torch as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
HERE = Path(__file__).resolve().parent


def dcp_error(call) -> BaseException:
    """The exception rank 0 raised inside a DCP call (DCP wraps it in a CheckpointException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as info:
        call()
    return info.value.failures[0][0]


def bf16_model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 16, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    return model, optimizer


def state_of(model, optimizer, epoch):
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {"epoch": epoch, "name": "run"}}


def assert_same_state(a, b):
    for key, tensor in a["model"].items():
        assert tensor.dtype == b["model"][key].dtype and torch.equal(tensor, b["model"][key]), key
    for index, values in a["optim"]["state"].items():
        for key, value in values.items():
            assert torch.equal(value, b["optim"]["state"][index][key]), (index, key)
    assert a["extra"] == b["extra"]


def test_dcp_save_async_save_and_load_in_one_process(cluster, job):
    model, optimizer = bf16_model_and_optimizer(1)
    saved = state_of(model, optimizer, 3)
    dcp.save(saved, storage_writer=st.Writer(job=job, step=1, server=cluster.address))
    future = dcp.async_save(saved, storage_writer=st.Writer(job=job, step=2, server=cluster.address))
    future.result()
    client = starckpt.Client(cluster.address, job)
    listed = client.list()
    assert [c["step"] for c in listed] == [1, 2] and all(c["world_size"] == 1 for c in listed)
    assert len({c["epoch"] for c in listed}) == 1  # a Writer per save: one lease, never fenced

    for step in (1, None):  # explicit, and the latest (2)
        other = state_of(*bf16_model_and_optimizer(2), 0)
        dcp.load(other, storage_reader=st.Reader(job=job, step=step, server=cluster.address))
        assert_same_state(saved, other)


def test_dcp_checkpoint_ids_name_job_and_step(cluster, job, monkeypatch):
    monkeypatch.setenv("STARCKPT_SERVER", cluster.address)
    sd = {"w": torch.randn(5, 5), "b": torch.randn(5)}
    dcp.save(sd, checkpoint_id=f"starckpt://{job}/40", storage_writer=st.Writer())
    loaded = {"w": torch.zeros(5, 5), "b": torch.zeros(5)}
    dcp.load(loaded, checkpoint_id=f"starckpt://{job}/40", storage_reader=st.Reader())
    assert torch.equal(loaded["w"], sd["w"]) and torch.equal(loaded["b"], sd["b"])
    assert st.Writer.validate_checkpoint_id(f"starckpt://{job}/40")
    assert not st.Writer.validate_checkpoint_id("/tmp/ckpt") and not st.Writer.validate_checkpoint_id(f"starckpt://{job}")
    assert st.Reader.validate_checkpoint_id(f"starckpt://{job}")
    # An operator's name of a tenant's job: the step is the last part, when it is a number.
    assert st.parse_checkpoint_id("starckpt://acme/llama/5") == ("acme/llama", 5)
    assert st.parse_checkpoint_id("starckpt://acme/llama") == ("acme/llama", None)
    assert st.parse_checkpoint_id(f"starckpt://{job}/40") == (job, 40)
    error = dcp_error(lambda: dcp.save(sd, storage_writer=st.Writer(job=job)))
    assert isinstance(error, starckpt.InvalidInputError) and "needs a step" in str(error)


def test_dcp_reader_refuses_what_is_not_a_dcp_checkpoint(cluster, job):
    starckpt.Client(cluster.address, job).save(1, {"x": 1}).wait()
    error = dcp_error(lambda: dcp.load({"x": torch.zeros(1)}, storage_reader=st.Reader(job=job, server=cluster.address)))
    assert "step 1 has no dcp/.metadata: it is not a DCP checkpoint" in str(error)  # DCP re-wraps metadata errors
    error = dcp_error(
        lambda: dcp.load({"x": torch.zeros(1)}, storage_reader=st.Reader(job=job, step=9, server=cluster.address))
    )
    assert "has no committed checkpoint at step 9" in str(error)


class _RunsCode:
    """Pickles to a call of ``os.mkdir(path)``: what a crafted metadata file could run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_dcp_reader_runs_no_code_from_the_metadata(cluster, job, tmp_path):
    from fractions import Fraction

    from torch.distributed.checkpoint.metadata import Metadata

    def save_metadata(step, metadata_bytes):
        client = starckpt.Client(cluster.address, job)
        native = client._client().save(client._job(), step, [(st.METADATA_FILE, metadata_bytes)], rank=0, world_size=1)
        assert native.wait()["committed"]

    marker = tmp_path / "ran"
    save_metadata(1, pickle.dumps(Metadata(state_dict_metadata={}, planner_data=_RunsCode(marker))))
    with pytest.raises(starckpt.FormatError, match=r"refers to posix\.mkdir"):
        st.Reader(job=job, step=1, server=cluster.address).read_metadata()
    assert not marker.exists(), "loading the metadata ran code from it"
    error = dcp_error(lambda: dcp.load({"x": torch.zeros(1)}, storage_reader=st.Reader(job=job, server=cluster.address)))
    assert "refers to posix.mkdir" in str(error) and not marker.exists()

    # A planner's own classes in the metadata load once the reader is told their names.
    save_metadata(2, pickle.dumps(Metadata(state_dict_metadata={}, planner_data=Fraction(1, 3))))
    with pytest.raises(starckpt.FormatError, match=r"refers to fractions\.Fraction"):
        st.Reader(job=job, step=2, server=cluster.address).read_metadata()
    reader = st.Reader(job=job, step=2, server=cluster.address, metadata_globals=[("fractions", "Fraction")])
    assert reader.read_metadata().planner_data == Fraction(1, 3)


def test_dcp_reader_checks_storage_entries_against_the_files(cluster, job):
    model, optimizer = bf16_model_and_optimizer(3)
    saved = state_of(model, optimizer, 1)
    dcp.save(saved, storage_writer=st.Writer(job=job, step=1, server=cluster.address))
    client = starckpt.Client(cluster.address, job)
    manifest = client.manifest(1)
    files = {path: manifest.read(path) for path, _ in manifest.files() if path != st.METADATA_FILE}
    metadata = pickle.loads(manifest.read(st.METADATA_FILE))
    index, info = next((i, s) for i, s in metadata.storage_data.items() if s.dtype is not None)

    def load_with(step, entry):
        metadata.storage_data[index] = entry
        data = [*files.items(), (st.METADATA_FILE, pickle.dumps(metadata))]
        assert client._client().save(client._job(), step, data, rank=0, world_size=1).wait()["committed"]
        target = state_of(*bf16_model_and_optimizer(4), 0)
        return dcp_error(lambda: dcp.load(target, storage_reader=st.Reader(job=job, step=step, server=cluster.address)))

    huge = st.StorageInfo(info.path, 1 << 50, info.dtype, info.shape)  # a petabyte, were it believed
    assert "the checkpoint holds" in str(load_with(2, huge))
    wrong_shape = st.StorageInfo(info.path, info.length, info.dtype, (info.length,))
    assert "is not" in str(load_with(3, wrong_shape))
    missing = st.StorageInfo("dcp/__9_9", info.length, info.dtype, info.shape)
    assert "not a file of the checkpoint" in str(load_with(4, missing))


def test_one_call_save_and_load_cover_model_optimizer_and_rng(cluster, job):
    model, optimizer = bf16_model_and_optimizer(1)
    torch.manual_seed(1234)
    random.seed(99)
    handle = st.save({"model": model, "optimizer": optimizer, "epoch": 5}, 100, job=job, server=cluster.address)
    assert handle.wait().committed
    expected_draws = (torch.rand(3), random.random())

    other_model, other_optimizer = bf16_model_and_optimizer(2)
    torch.manual_seed(0)
    random.seed(0)
    loaded = st.load({"model": other_model, "optimizer": other_optimizer}, job=job, server=cluster.address)
    assert loaded["epoch"] == 5
    assert torch.equal(torch.rand(3), expected_draws[0]) and random.random() == expected_draws[1]
    for (name, p), q in zip(model.state_dict().items(), other_model.state_dict().values()):
        assert torch.equal(p, q), name
    assert_same_state(state_of(model, optimizer, 0), state_of(other_model, other_optimizer, 0))
    with pytest.raises(starckpt.NotFoundError):
        st.load(job=f"{job}-none", server=cluster.address)


def torchrun(cluster, job, args: list[str], env_extra=None, timeout=300) -> subprocess.CompletedProcess:
    env = python_env(cluster, OMP_NUM_THREADS="1", **(env_extra or {}))
    return run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args], env, timeout)


def test_dcp_with_two_ranks_and_loading_with_another_world_size(cluster, job):
    out = torchrun(cluster, job, [str(HERE / "dcp_ranks.py"), "save", job, "5"])
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"saved": 5}
    listed = starckpt.Client(cluster.address, job).list()
    # Two ranks' data parts plus DCP's metadata part, all in.
    assert [(c["step"], c["world_size"], c["parts_committed"]) for c in listed] == [(5, 3, 3)]

    out = torchrun(cluster, job, [str(HERE / "dcp_ranks.py"), "load", job, "5"])
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"loaded": True}

    # One process reads the tensor sharded over two ranks, whole.
    sys.path.insert(0, str(HERE))
    try:
        from dcp_ranks import FULL
    finally:
        sys.path.remove(str(HERE))
    state = {"sharded": torch.zeros_like(FULL), "replicated": torch.zeros(10), "rank/1": torch.zeros(3), "epoch": 0}
    dcp.load(state, storage_reader=st.Reader(job=job, server=cluster.address))
    assert torch.equal(state["sharded"], FULL) and torch.equal(state["rank/1"], torch.ones(3))
    assert torch.equal(state["replicated"], torch.linspace(0, 1, 10)) and state["epoch"] == 7

    # And the other way: saved whole by one process, loaded as shards by two (each rank reads
    # only its rows of the stored tensor).
    whole = {"sharded": FULL, "replicated": torch.linspace(0, 1, 10), "rank/0": torch.zeros(3), "rank/1": torch.ones(3),
             "epoch": 7}
    dcp.save(whole, storage_writer=st.Writer(job=f"{job}-whole", step=6, server=cluster.address))
    out = torchrun(cluster, job, [str(HERE / "dcp_ranks.py"), "load", f"{job}-whole", "6"])
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"loaded": True}


# -- the example trainer: SIGKILL and resume --------------------------------------------------


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(records: list[dict]) -> dict[int, float]:
    """Step -> loss of the last run that logged the step (a resumed run repeats steps)."""
    return {r["step"]: r["loss"] for r in records if "step" in r}


def processes_running(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                status = (entry / "stat").read_text()
            except OSError:
                continue
            if marker.encode() in cmdline and status.rsplit(")", 1)[-1].split()[0] != "Z":
                pids.append(int(entry.name))
    return pids


def run_killed_and_resumed(cluster, job, tmp_path, command: list[str], seed: int, steps: int, env_extra=None):
    """Starts `command`, SIGKILLs its process group when the log reaches a random step, restarts
    it to completion; returns the log records."""
    log = tmp_path / f"{job}.jsonl"
    env = python_env(cluster, STARCKPT_JOB=job, OMP_NUM_THREADS="1", **(env_extra or {}))
    kill_at = random.Random(seed).randrange(25, steps - 20)
    full = [*command, "--job", job, "--steps", str(steps), "--save-every", "10", "--loss-log", str(log)]
    stderr = tmp_path / f"{job}.stderr"
    with open(stderr, "wb") as errors:
        proc = subprocess.Popen([sys.executable, *full], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=errors)
    deadline = time.monotonic() + 240
    while not any(r.get("step") == kill_at for r in read_log(log)):
        assert proc.poll() is None, f"trainer exited before step {kill_at}: {stderr.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "trainer too slow"
        time.sleep(0.01)
    # Like a preempted node: the launcher and every worker (torchrun starts workers in sessions
    # of their own, so a process-group kill would miss them) die at once.
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in processes_running(job):
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    while processes_running(job):
        time.sleep(0.01)
    killed = read_log(log)
    run_python(full, env, timeout=300)
    records = read_log(log)
    resumed = [r["resumed_from"] for r in records if "resumed_from" in r]
    assert len(resumed) == 1, records[-5:]
    saved_before_kill = [r["saved"] for r in killed if "saved" in r]
    # It resumes from the newest committed save: at least the last one it logged as saved.
    assert resumed[0] >= max(saved_before_kill, default=-1) and resumed[0] <= kill_at + 10
    return records


def test_example_trainer_resumes_after_sigkill_with_identical_losses(cluster, job, tmp_path):
    steps = 120
    command = [str(EXAMPLES / "train.py"), "--step-sleep", "0.01"]
    reference_log = tmp_path / "reference.jsonl"
    run_python([*command, "--job", f"{job}-ref", "--steps", str(steps), "--loss-log", str(reference_log)],
               python_env(cluster, OMP_NUM_THREADS="1"))
    reference = losses(read_log(reference_log))
    assert sorted(reference) == list(range(steps))

    records = run_killed_and_resumed(cluster, job, tmp_path, command, seed=int(os.environ.get("STARCKPT_TEST_SEED", "7")), steps=steps)
    interrupted = losses(records)
    assert sorted(interrupted) == list(range(steps))
    mismatched = [s for s in range(steps) if interrupted[s] != reference[s]]
    assert not mismatched, f"steps whose loss differs after resuming: {mismatched[:10]}"
    assert starckpt.Client(cluster.address, job).latest() == steps - 1


def test_example_trainer_with_two_ranks_resumes_after_sigkill(cluster, job, tmp_path):
    steps = 80
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "train.py")]
    reference_log = tmp_path / "reference.jsonl"
    run_python([*launcher, "--job", f"{job}-ref", "--steps", str(steps), "--loss-log", str(reference_log)],
               python_env(cluster, OMP_NUM_THREADS="1"), timeout=300)
    reference = losses(read_log(reference_log))

    records = run_killed_and_resumed(cluster, job, tmp_path, [*launcher, "--step-sleep", "0.02"], seed=11, steps=steps)
    interrupted = losses(records)
    assert sorted(interrupted) == list(range(steps))
    assert [s for s in range(steps) if interrupted[s] != reference[s]] == []
    checkpoints = starckpt.Client(cluster.address, job).list()
    assert checkpoints[-1]["step"] == steps - 1 and checkpoints[-1]["world_size"] == 3


def test_a_reader_fetches_only_the_rows_a_shard_needs():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from starckpt.torch import StorageInfo, _rows_needed

    info = StorageInfo("dcp/__0_0", 64 * 6 * 2, "bfloat16", (64, 6))

    def read(offsets, lengths):
        index = MetadataIndex("w", [0, 0])
        return ReadItem(LoadItemType.TENSOR, index, [0, 0], index, offsets, lengths)

    rows = _rows_needed(info, [read([32, 0], [32, 6])])
    assert (rows.first, rows.count, rows.offset, rows.nbytes) == (32, 32, 32 * 12, 32 * 12)
    rows = _rows_needed(info, [read([8, 0], [8, 6]), read([40, 0], [4, 6])])
    assert (rows.first, rows.count) == (8, 36)
    assert _rows_needed(info, [read([0, 2], [64, 4])]).count is None  # a column slice: whole file
