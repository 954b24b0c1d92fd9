"""The training frameworks, unchanged, checkpointing into a job directory of the FUSE mount: HF
Transformers `Trainer`, Lightning `ModelCheckpoint`, DCP's `FileSystemWriter` written in place
(torchtitan's way, one and two ranks), DeepSpeed's `save_checkpoint`/`load_checkpoint`, a
Megatron-style tracker file, safetensors, a large `torch.save` zip, and `cp -a`/`rsync -a`/`tar -x`
into a draft. Each runs the real package from PyPI (scripts/test installs them) against a real
cluster of `starckpt` processes and a real mount; tiny models are built from configs.

Needs root and /dev/fuse (skipped without). The mount's rules: fuse/src/lib.rs.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Cluster, python_env, run_python, starckpt_bin

FRAMEWORKS = Path(__file__).parent / "frameworks"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="the FUSE mount needs root and /dev/fuse"
)


class Mount:
    """`starckpt mount POINT` over a cluster, until stopped."""

    def __init__(self, cluster: Cluster, point: Path, *flags: str):
        self.point = point
        point.mkdir(parents=True, exist_ok=True)
        self.log = point.parent / f"{point.name}.log"
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(
                [starckpt_bin(), "mount", str(point), *flags],
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, "STARCKPT_SERVER": cluster.address, "RUST_LOG": "info"},
            )
        line = self.popen.stdout.readline().decode()
        if "mounted at" not in line:
            self.stop()
            raise RuntimeError(f"the mount did not come up: {line!r}; log: {self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        subprocess.run(["umount", "-l", str(self.point)], capture_output=True)


@pytest.fixture(scope="module")
def mounted(cluster, tmp_path_factory):
    mount = Mount(cluster, tmp_path_factory.mktemp("mnt") / "ckpt")
    yield mount
    mount.stop()


def committed(cluster: Cluster, job: str) -> dict[int, str]:
    """Step → state of every checkpoint of `job` the control plane has."""
    out = cluster.cli("ls", job, "--all", "--json")
    assert out.returncode == 0, out.stderr
    return {c["step"]: c["state"] for c in json.loads(out.stdout)}


def run(args: list[str], cluster: Cluster, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=python_env(cluster), capture_output=True, text=True, timeout=timeout
    )


def losses(stdout: str) -> dict[int, float]:
    return {int(step): float(value) for _, step, value in (line.split() for line in stdout.splitlines() if line.startswith("loss "))}


def test_hf_trainer_rotates_and_resumes_after_a_kill_mid_save(cluster, mounted, job, tmp_path):
    pytest.importorskip("transformers")
    script = str(FRAMEWORKS / "hf_trainer.py")
    out = mounted.point / job
    os.mkdir(out)
    # Killed in the middle of saving checkpoint-10: nothing of it is committed or listed.
    killed = run([script, str(out), "12", "--kill-at", "10"], cluster)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(os.listdir(out)) == ["checkpoint-5"]
    assert committed(cluster, job) == {5: "committed"}
    resumed = run([script, str(out), "20", "--resume", "--save-model"], cluster)
    assert resumed.returncode == 0, resumed.stderr
    # save_total_limit=2 removed the older checkpoints with shutil.rmtree; save_model() wrote the
    # model at the top, as job files (no checkpoint of their own).
    checkpoints = [name for name in sorted(os.listdir(out)) if name.startswith("checkpoint-")]
    assert checkpoints == ["checkpoint-15", "checkpoint-20"]
    assert {"model.safetensors", "config.json", "training_args.bin"} <= set(os.listdir(out))
    assert committed(cluster, job) == {5: "deleted", 10: "deleted", 15: "committed", 20: "committed"}
    assert json.loads((out / "checkpoint-20" / "trainer_state.json").read_text())["global_step"] == 20

    # The same kill and resume on a local disk (where the half-written checkpoint-10 must be
    # removed by hand first) gives the very same losses: the mount restored every byte.
    local = tmp_path / "local"
    assert run([script, str(local), "12", "--kill-at", "10"], cluster).returncode == -signal.SIGKILL
    shutil.rmtree(local / "checkpoint-10")
    on_disk = run([script, str(local), "20", "--resume", "--save-model"], cluster)
    assert on_disk.returncode == 0, on_disk.stderr
    assert losses(resumed.stdout) == losses(on_disk.stdout)
    assert sorted(os.listdir(out)) == sorted(os.listdir(local))
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (local / name).read_bytes(), name
    assert sorted(losses(resumed.stdout)) == list(range(6, 21))
    # And close to a run never interrupted (HF's resume itself is not bit-exact on CPU).
    straight = run([script, str(tmp_path / "straight"), "20"], cluster)
    assert straight.returncode == 0, straight.stderr
    for step, loss in losses(resumed.stdout).items():
        assert abs(loss - losses(straight.stdout)[step]) < 0.01 * loss, step


LIGHTNING = """
import os, sys, torch, lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
out, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)
    def training_step(self, batch, _):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("progress", float(self.global_step))
        print(f"loss {self.global_step} {loss.item():.6f}", flush=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
torch.manual_seed(0)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 32)), batch_size=4)
checkpoints = ModelCheckpoint(dirpath=out, save_top_k=2, monitor="progress", mode="max", every_n_train_steps=5)
trainer = L.Trainer(max_steps=steps, accelerator="cpu", callbacks=[checkpoints], logger=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny(), data, ckpt_path=resume)
print("best", os.path.basename(checkpoints.best_model_path))
"""


def test_lightning_model_checkpoint_keeps_top_k_and_resumes(cluster, mounted, job, tmp_path):
    pytest.importorskip("lightning")
    out = mounted.point / job
    first = run(["-c", LIGHTNING, str(out), "20"], cluster)
    assert first.returncode == 0, first.stderr
    # Written to a temporary file elsewhere and moved in (copy, then copystat), older ones
    # removed: the two newest are left, each a one-file checkpoint.
    assert sorted(os.listdir(out)) == ["epoch=0-step=15.ckpt", "epoch=0-step=20.ckpt"]
    assert committed(cluster, job) == {5: "deleted", 10: "deleted", 15: "committed", 20: "committed"}
    resumed = run(["-c", LIGHTNING, str(out), "30", str(out / "epoch=0-step=20.ckpt")], cluster)
    assert resumed.returncode == 0, resumed.stderr
    assert min(losses(resumed.stdout)) == 20, "the resume did not start at the checkpoint's step"
    # What Lightning keeps after a resume is its own rule: the same as on a local disk.
    local = tmp_path / "local"
    assert run(["-c", LIGHTNING, str(local), "20"], cluster).returncode == 0
    on_disk = run(["-c", LIGHTNING, str(local), "30", str(local / "epoch=0-step=20.ckpt")], cluster)
    assert on_disk.returncode == 0, on_disk.stderr
    assert sorted(os.listdir(out)) == sorted(os.listdir(local))
    assert losses(resumed.stdout) == losses(on_disk.stdout)
    steps = {name: state for name, state in committed(cluster, job).items() if state == "committed"}
    assert sorted(steps) == sorted(int(n.split("step=")[1].split(".")[0]) for n in os.listdir(local))


def test_lightning_save_last_is_a_job_file_to_resume_from(cluster, mounted, job, tmp_path):
    pytest.importorskip("lightning")
    script = LIGHTNING.replace("every_n_train_steps=5)", "every_n_train_steps=5, save_last=True)")
    assert script != LIGHTNING
    out, local = mounted.point / job, tmp_path / "local"
    assert run(["-c", script, str(out), "20"], cluster).returncode == 0
    assert run(["-c", script, str(local), "20"], cluster).returncode == 0
    # last.ckpt is rewritten at every save (moved in over the one before): a job file, no step.
    assert sorted(os.listdir(out)) == sorted(os.listdir(local))
    assert "last.ckpt" in os.listdir(out)
    assert {step for step, state in committed(cluster, job).items() if state == "committed"} == {15, 20}
    assert os.readlink(out / ".starckpt" / "latest") == "../epoch=0-step=20.ckpt"
    # Resumed from it, on the mount and on a local disk: the same steps and losses.
    resumed = run(["-c", script, str(out), "30", str(out / "last.ckpt")], cluster)
    assert resumed.returncode == 0, resumed.stderr
    on_disk = run(["-c", script, str(local), "30", str(local / "last.ckpt")], cluster)
    assert on_disk.returncode == 0, on_disk.stderr
    assert min(losses(resumed.stdout)) == 20
    assert losses(resumed.stdout) == losses(on_disk.stdout)
    assert sorted(os.listdir(out)) == sorted(os.listdir(local))


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_filesystem_writer_in_place_commits_at_its_metadata(cluster, mounted, job, world):
    pytest.importorskip("torch")
    step_dir = mounted.point / job / "step-100"
    saved = run([str(FRAMEWORKS / "dcp_in_place.py"), str(step_dir), str(world)], cluster)
    assert saved.returncode == 0, saved.stderr
    # Committed by `.metadata` landing, under its own name, without a rename.
    assert committed(cluster, job) == {100: "committed"}
    assert ".metadata" in os.listdir(step_dir)
    # A fresh process loads it (through the committed checkpoint).
    loader = "import sys, torch, torch.distributed.checkpoint as dcp\n" \
             "sd = {'w0': torch.zeros(512, 1024), 'shared': torch.zeros(1000, dtype=torch.long)}\n" \
             "dcp.load(sd, checkpoint_id=sys.argv[1])\n" \
             "g = torch.Generator().manual_seed(0)\n" \
             "assert torch.equal(sd['w0'], torch.randn(512, 1024, generator=g))\nprint('ok')"
    assert run(["-c", loader, str(step_dir)], cluster).stdout.strip() == "ok"


DEEPSPEED = """
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
config = {"train_batch_size": 4, "zero_optimization": {"stage": 0}}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=config)
save_dir = sys.argv[1]
for step in range(3):
    loss = engine(torch.randn(4, 16)).pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(save_dir)
weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
with torch.no_grad():
    for p in engine.module.parameters():
        p.zero_()
path, _ = engine.load_checkpoint(save_dir)
assert all(torch.equal(weights[k], v) for k, v in engine.module.state_dict().items())
print("loaded", os.path.basename(os.path.dirname(path)))
"""


def test_deepspeed_checkpoint_commits_when_its_latest_file_names_it(cluster, mounted, job):
    pytest.importorskip("deepspeed")
    out = mounted.point / job
    os.mkdir(out)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**python_env(cluster), "DS_ACCELERATOR": "cpu"}
    saved = subprocess.run([sys.executable, "-c", DEEPSPEED, str(out), str(port)], env=env, capture_output=True,
                           text=True, timeout=600)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert "loaded global_step3" in saved.stdout, saved.stdout
    assert (out / "latest").read_text() == "global_step3"
    assert committed(cluster, job) == {3: "committed"}
    assert sorted(os.listdir(out)) == ["global_step3", "latest"]


def test_a_megatron_tracker_file_commits_its_iteration_and_is_kept(cluster, mounted, job, tmp_path):
    out = mounted.point / job
    os.mkdir(out)
    (out / "iter_0000500" / "mp_rank_00").mkdir(parents=True)
    (out / "iter_0000500" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(os.urandom(3 << 20))
    # Not committed until the tracker names it.
    assert committed(cluster, job) == {}
    (out / "latest_checkpointed_iteration.txt").write_text("500")
    assert committed(cluster, job) == {500: "committed"}
    assert sorted(os.listdir(out)) == ["iter_0000500", "latest_checkpointed_iteration.txt"]
    # Another mount (a restarted host) lists it and reads the tracker back as written.
    other = Mount(cluster, tmp_path / "other")
    try:
        assert (other.point / job / "latest_checkpointed_iteration.txt").read_text() == "500"
        assert os.path.getsize(other.point / job / "iter_0000500" / "mp_rank_00" / "model_optim_rng.pt") == 3 << 20
        assert os.readlink(other.point / job / ".starckpt" / "latest") == "../iter_0000500"
    finally:
        other.stop()


def test_safetensors_and_a_large_torch_zip(cluster, mounted, job):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    script = f"""
import os, torch
from safetensors.torch import save_file, load_file
job = {str(mounted.point / job)!r}
os.makedirs(job + "/checkpoint-7")
t = {{"a": torch.randn(1000, 1000), "b": torch.arange(7)}}
save_file(t, job + "/checkpoint-7/model.safetensors")   # ftruncate to its size, then writes
assert torch.equal(load_file(job + "/checkpoint-7/model.safetensors")["a"], t["a"])  # a draft, read back
os.rename(job + "/checkpoint-7", job + "/ckpt-7")
assert torch.equal(load_file(job + "/ckpt-7/model.safetensors")["a"], t["a"])
# Straight into the job directory: safetensors writes `.tmpXXXXXX` and renames it into place
# while it is still open; the classic atomic write renames `NAME.tmp` after closing it.
save_file(t, job + "/model-9.safetensors")
assert torch.equal(load_file(job + "/model-9.safetensors")["a"], t["a"])
torch.save(t, job + "/weights_10.pt.tmp")
os.replace(job + "/weights_10.pt.tmp", job + "/weights_10.pt")
assert torch.equal(torch.load(job + "/weights_10.pt")["a"], t["a"])
assert sorted(os.listdir(job)) == ["ckpt-7", "model-9.safetensors", "weights_10.pt"], os.listdir(job)
big = {{f"layer{{i}}": torch.randn(4 << 20) for i in range(20)}}   # 320 MiB
torch.save(big, job + "/model_8.pt")
back = torch.load(job + "/model_8.pt")
assert all(torch.equal(back[k], big[k]) for k in big)
print("ok")
"""
    assert run(["-c", script], cluster).stdout.strip() == "ok"
    assert committed(cluster, job) == {7: "committed", 8: "committed", 9: "committed", 10: "committed"}


def test_cp_rsync_and_tar_into_drafts(cluster, mounted, job, tmp_path):
    source = tmp_path / "source"
    (source / "sub" / "deep").mkdir(parents=True)
    (source / "a.bin").write_bytes(os.urandom(5 << 20))
    (source / "sub" / "b.txt").write_text("b")
    (source / "sub" / "deep" / "c").write_bytes(b"")
    os.chmod(source / "sub" / "b.txt", 0o640)
    os.utime(source / "a.bin", (1_000_000_000, 1_000_000_000))
    out = mounted.point / job
    os.mkdir(out)
    tarball = tmp_path / "t.tar"
    subprocess.run(["tar", "cf", str(tarball), "-C", str(source), "."], check=True)
    for tool, step in [("cp", 1), ("rsync", 2), ("tar", 3)]:
        draft = out / f"{tool}.tmp"
        os.mkdir(draft)
        if tool == "cp":
            cmd = ["cp", "-a", f"{source}/.", str(draft)]
        elif tool == "rsync":
            cmd = ["rsync", "-a", f"{source}/", f"{draft}/"]
        else:
            cmd = ["tar", "xf", str(tarball), "-C", str(draft)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{tool}: {done.stderr}"
        # Before the commit, the draft reads back as written.
        assert (draft / "a.bin").read_bytes() == (source / "a.bin").read_bytes(), tool
        os.rename(draft, out / f"{tool}-{step}")
        final = out / f"{tool}-{step}"
        assert (final / "a.bin").read_bytes() == (source / "a.bin").read_bytes(), tool
        assert (final / "sub" / "b.txt").read_text() == "b"
        # Its permission bits as set (0640), less write bits: a committed checkpoint is read-only.
        assert oct(os.stat(final / "sub" / "b.txt").st_mode & 0o777) == "0o440", tool
        assert os.path.isdir(final / "sub" / "deep")
    assert committed(cluster, job) == {1: "committed", 2: "committed", 3: "committed"}


def test_bad_input_gets_an_errno_and_never_a_partial_checkpoint(cluster, job, tmp_path):
    # A mount with a tiny spill area: a file patched out of order past it is refused.
    mount = Mount(cluster, tmp_path / "small", "--spill-limit", "1MiB")
    try:
        out = mount.point / job
        os.mkdir(out)
        os.mkdir(out / "checkpoint-1")
        script = f"""
import errno, os
f = open({str(out / "checkpoint-1" / "big")!r}, "wb", buffering=0)
f.write(b"x" * (3 << 20))   # in order: streams on without its copy past the spill area
try:
    f.seek(0); f.write(b"y"); print("patched")
except OSError as e:
    print(errno.errorcode[e.errno])
try:
    f.close()
except OSError as e:
    print("close", errno.errorcode[e.errno])
"""
        result = run(["-c", script], cluster)
        assert result.stdout.split() == ["ENOTSUP", "close", "ENOTSUP"], result.stdout + result.stderr
        # The file failed: the draft cannot commit, and nothing is.
        with pytest.raises(OSError) as failed:
            os.rename(out / "checkpoint-1", out / "ckpt-1")
        assert failed.value.errno in (5, 95)
        assert committed(cluster, job) == {}
        # A tracker naming nothing is kept (a job file) and commits nothing.
        (out / "latest").write_text("global_step999")
        assert (out / "latest").read_text() == "global_step999"
        assert committed(cluster, job) == {}
        # A step that is committed cannot be written again.
        os.mkdir(out / "checkpoint-2")
        (out / "checkpoint-2" / "f").write_bytes(b"x")
        os.rename(out / "checkpoint-2", out / "step-2")
        with pytest.raises(FileExistsError):
            os.mkdir(out / "step-2")
        os.mkdir(out / "again-2")
        with pytest.raises(FileExistsError):
            os.rename(out / "again-2", out / "step-2")
        assert committed(cluster, job) == {2: "committed"}
    finally:
        mount.stop()
