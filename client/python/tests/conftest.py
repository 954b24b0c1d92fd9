"""Test harness: a real cluster (a control plane and targets, each a `starckpt` process on
127.0.0.1) per test module, killed afterwards.

The binary is $STARCKPT_BIN, else the workspace's target/debug/starckpt (built by `cargo test`
or `cargo build -p starckpt`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "client" / "python" / "examples"


def starckpt_bin() -> str:
    explicit = os.environ.get("STARCKPT_BIN")
    if explicit:
        return explicit
    built = REPO / "target" / "debug" / "starckpt"
    if not built.exists():
        subprocess.run(["cargo", "build", "-q", "-p", "starckpt"], cwd=REPO, check=True)
    return str(built)


class Proc:
    """A `starckpt` process; its first stdout line ends with the address it listens on."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        with open(log, "ab") as log_file:
            self.popen = subprocess.Popen(
                [starckpt_bin(), *args], stdout=subprocess.PIPE, stderr=log_file, env={**os.environ, "RUST_LOG": "info"}
            )
        line = self.popen.stdout.readline().decode()
        self.address = line.strip().rsplit(" ", 1)[-1]
        if ":" not in self.address:
            self.kill()
            raise RuntimeError(f"no address from starckpt {args}: {line!r}; log: {log.read_text()}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)


class Cluster:
    """A control plane and `targets` targets. With `tokens_file`, the control plane serves only
    its bearer tokens, and the harness's own commands carry `admin_token`. With `tls` (a CA file,
    a certificate it signed for 127.0.0.1 and its key: `tls_certificate`), the control plane
    serves TLS only, and the targets and the harness's commands trust that CA."""

    def __init__(
        self,
        root: Path,
        targets: int = 2,
        tokens_file: Path | None = None,
        admin_token: str | None = None,
        tls: tuple[Path, Path, Path] | None = None,
    ):
        self.root = root
        self.cli_env = {"STARCKPT_TOKEN": admin_token} if admin_token else {}
        serve_tls = ["--tls-cert", str(tls[1]), "--tls-key", str(tls[2])] if tls else []
        trust = ["--tls-ca", str(tls[0])] if tls else []
        if tls:
            self.cli_env["STARCKPT_TLS_CA"] = str(tls[0])
        # One key for the control plane and the targets: clients' requests carry capabilities.
        key = root / "cluster.key"
        key.write_bytes(os.urandom(32))
        keyed = ["--cluster-key-file", str(key)]
        tokens = ["--tokens-file", str(tokens_file)] if tokens_file else []
        self.server = Proc(
            ["server", "--listen", "127.0.0.1:0", "--db", str(root / "meta.db"), *keyed, *tokens, *serve_tls],
            root / "server.log",
        )
        self.targets = [
            Proc(
                # A fixed queue depth: measuring the device (`auto`) writes 1.5 GiB per target.
                ["target", "--dir", str(root / f"target-{i}"), "--listen", "127.0.0.1:0", "--server", self.server.address,
                 "--queue-depth", "8", *keyed, *trust],
                root / f"target-{i}.log",
            )
            for i in range(targets)
        ]
        self.wait_alive()

    @property
    def address(self) -> str:
        return self.server.address

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [starckpt_bin(), *args],
            capture_output=True,
            env={**os.environ, "STARCKPT_SERVER": self.address, **self.cli_env},
        )

    def wait_alive(self) -> None:
        deadline = time.monotonic() + 20
        while True:
            out = self.cli("status", "--json")
            if out.returncode == 0:
                listed = json.loads(out.stdout).get("targets", [])
                if all(any(t["state"] == "alive" and t["data_address"] == p.address for t in listed) for p in self.targets):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"targets did not come alive: {out.stdout!r} {out.stderr!r}")
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in [*self.targets, self.server]:
            proc.kill()


def tls_certificate(root: Path) -> tuple[Path, Path, Path]:
    """A CA (ca.pem) and a certificate it signed for 127.0.0.1 (cert.pem, key.pem) in `root`,
    made with openssl as an operator would."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=root)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=starckpt test CA")
    openssl("req", *ec, "-keyout", "key.pem", "-out", "cert.csr", "-subj", "/CN=127.0.0.1")
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "cert.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "cert.pem", "-days", "2", "-extfile", "san.ext")
    return root / "ca.pem", root / "cert.pem", root / "key.pem"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()


_jobs = iter(range(1_000_000))


@pytest.fixture
def job(request) -> str:
    """A job name unique to the test."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40].strip("-")
    return f"{name}-{next(_jobs)}"


def python_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STARCKPT_", "TORCHELASTIC_"))}
    env.update({"STARCKPT_SERVER": cluster.address, "PYTHONUNBUFFERED": "1", **extra})
    return env


def run_python(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"{args} exited {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}")
    return out


__all__ = ["Cluster", "Proc", "EXAMPLES", "python_env", "run_python", "signal"]
