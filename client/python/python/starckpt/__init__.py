"""starckpt: checkpoints for training jobs.

>>> import starckpt, numpy as np
>>> client = starckpt.Client(job="llama")          # STARCKPT_SERVER / STARCKPT_JOB by default
>>> handle = client.save(100, {"w": np.ones(4), "step": 100})   # returns once staged
>>> handle.wait().committed
True
>>> client.latest()
100
>>> state, metadata = client.load()

``save`` copies every array and tensor straight into the SDK's staging buffers with the GIL
released (the one copy the trainer waits for); chunking, hashing, deduplication, upload and the
commit continue in the background. ``load`` reads each leaf, verified against its BLAKE3 hash,
straight into the array that it returns.

One connection (and one writer lease per job) serves the whole process: every ``Client``,
``starckpt.torch.Writer`` and ``Reader`` for the same server shares it, so creating a new one per
save never fences the process's own earlier saves. A new process is a new run and fences the
previous one (set ``STARCKPT_RUN_ID``, or run under torchrun, to share a run across ranks; a
relaunch needs a new ``STARCKPT_RUN_ID``, or it joins the unfinished checkpoint of the launch
before).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import _native, _state
from .errors import (
    AlreadyExistsError,
    CancelledError,
    ChecksumError,
    DeniedError,
    ClosedError,
    ConnectionError,
    FencedError,
    FormatError,
    IncompleteCheckpointWarning,
    InvalidInputError,
    NotFoundError,
    RejectedError,
    StarckptError,
    StarckptIOError,
    TargetError,
    UnavailableError,
    UnsupportedTypeError,
)

__version__ = _native.__version__

DEFAULT_SERVER = "127.0.0.1:7070"
# Part metadata keys this SDK writes.
_META_USER = "starckpt.python.metadata"
_META_FORMAT = "starckpt.python.format"

_shared_lock = threading.Lock()
_shared: dict[tuple[int, str, int | None, str | None, str | None], _native.NativeClient] = {}


def _bearer_token(token: str | None) -> str | None:
    """The bearer token a client uses: `token`, else ``$STARCKPT_TOKEN``, else the contents of the
    file ``$STARCKPT_TOKEN_FILE`` names (resolved here, so clients of different tokens never
    share a native client)."""
    if token is not None:
        return token
    if os.environ.get("STARCKPT_TOKEN"):
        return os.environ["STARCKPT_TOKEN"]
    path = os.environ.get("STARCKPT_TOKEN_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            raise StarckptIOError(f"read the token file {path}: {e}") from None
    return None


def _native_client(
    server: str, compress: int | None = None, token: str | None = None, tls_ca: str | None = None
) -> _native.NativeClient:
    """The process's one native client for `server`, compression level, bearer token and TLS CA
    file (a forked child gets its own)."""
    tls_ca = tls_ca or os.environ.get("STARCKPT_TLS_CA") or None
    key = (os.getpid(), server, compress, token, tls_ca)
    with _shared_lock:
        client = _shared.get(key)
        if client is None:
            # A second native client (another compression level) must write as the same run, or
            # taking the job's lease would fence this process's other saves.
            sibling = next((c for (pid, srv, *_), c in _shared.items() if pid == key[0] and srv == server), None)
            run_id = sibling.run_id if sibling is not None else None
            client = _native.NativeClient(server, compress_level=compress, run_id=run_id, token=token, tls_ca=tls_ca)
            _shared[key] = client
        return client


def compress_chunk(data: bytes, level: int = 1) -> tuple[str, bytes] | None:
    """Encodes one chunk as a client with ``compress=level`` does: ``(codec, stored bytes)``, or
    None when no codec shrinks it by 5% (it would be stored as it is). For measuring the codecs
    on your own tensors; saves compress by themselves."""
    return _native.compress_chunk(data, level)


def decompress_chunk(codec: str, data: bytes, length: int) -> bytes:
    """Decodes what :func:`compress_chunk` returned; ``length`` is the chunk's length."""
    return _native.decompress_chunk(codec, data, length)


# Saves not known to be finished: waited for at interpreter exit, so a script whose last line
# is a non-blocking save still commits it (or says why not).
_unfinished: set[SaveHandle] = set()
_unfinished_lock = threading.Lock()


def _track(handle: SaveHandle) -> None:
    with _unfinished_lock:
        # A failure nobody has been told of stays, for the exit hook to report.
        for done in [h for h in _unfinished if h._finished_here() and not h._failed_unreported()]:
            _unfinished.discard(done)
        _unfinished.add(handle)


def _reset_after_fork() -> None:
    """In a forked child: locks another thread of the parent may have held at the fork are
    replaced (a plain lock stays held in the child forever), and the parent's objects are
    forgotten (the child makes its own client; the parent's saves are the parent's)."""
    global _shared_lock, _unfinished_lock
    _shared_lock = threading.Lock()
    _unfinished_lock = threading.Lock()
    _shared.clear()
    _unfinished.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


@atexit.register
def _wait_for_saves_at_exit() -> None:
    with _unfinished_lock:
        pending = [h for h in _unfinished if h._pid == os.getpid()]
        _unfinished.clear()
    for handle in pending:
        if handle._reported:
            continue
        try:
            handle.wait()
        except Exception as e:  # noqa: BLE001 - reported, the interpreter is exiting anyway
            print(f"starckpt: the save of step {handle.step} failed: {e}", file=sys.stderr)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise InvalidInputError(f"${name} is {text!r}, not an integer") from None


@dataclass(frozen=True)
class SaveOutcome:
    """What a finished save did."""

    checkpoint_id: int
    job: str
    step: int
    #: True when every rank's part is in and the checkpoint is visible to ``latest``.
    committed: bool
    #: For a multi-rank checkpoint still waiting for ranks: parts in, of world_size.
    parts_committed: int | None
    world_size: int | None
    epoch: int
    total_bytes: int
    uploaded_bytes: int
    chunks: int
    deduplicated_chunks: int


class SaveHandle:
    """A save whose bytes are staged; the upload and commit continue in the background."""

    def __init__(self, native: _native.SaveHandle, step: int):
        self._native = native
        self.step = step
        self._pid = os.getpid()
        #: Its outcome reached the caller (``wait`` returned or raised).
        self._reported = False

    def _finished_here(self) -> bool:
        return self._pid != os.getpid() or self._native.done()

    def _failed_unreported(self) -> bool:
        """Finished, failed, and nobody was told yet."""
        if self._reported or self._pid != os.getpid() or not self._native.done():
            return False
        try:
            self._native.wait(0)
        except Exception:  # noqa: BLE001 - whatever the save's error, it failed
            return True
        return False

    def staged(self) -> bool:
        """True once every byte of the save is in staging buffers (or handed to the uploaders)."""
        progress = self._native.progress()
        return progress["staged_bytes"] >= progress["total_bytes"]

    def done(self) -> bool:
        """True once the upload and commit have finished, successfully or not."""
        return self._native.done()

    @property
    def progress(self) -> dict[str, int]:
        """Live byte and chunk counters (staged, copied, uploaded, deduplicated, done)."""
        return self._native.progress()

    def wait(self, timeout: float | None = None) -> SaveOutcome:
        """Blocks (GIL released, Ctrl-C honoured) until the part is committed and returns the
        outcome; raises the save's error if it failed, ``TimeoutError`` after `timeout` seconds."""
        try:
            outcome = SaveOutcome(**self._native.wait(timeout))
        except TimeoutError:
            raise
        except BaseException:
            self._reported = self._native.done()
            raise
        self._reported = True
        return outcome

    def __repr__(self) -> str:
        return f"<starckpt.SaveHandle step={self.step} done={self.done()}>"


class Client:
    """A trainer's handle on one job of a starckpt cluster.

    ``server`` defaults to ``$STARCKPT_SERVER`` (else 127.0.0.1:7070), ``job`` to
    ``$STARCKPT_JOB``. ``token`` is the bearer token of a cluster that requires one (``starckpt
    server --tokens-file``); it defaults to ``$STARCKPT_TOKEN``, else the contents of the file
    ``$STARCKPT_TOKEN_FILE`` names, and decides whose jobs the client reaches (a tenant's token:
    that tenant's alone, by their short names). ``tls_ca`` (default ``$STARCKPT_TLS_CA``) is the
    PEM file of the CA a control plane's TLS certificate chains to (``starckpt server
    --tls-cert``): addresses without a scheme are then dialled over TLS, trusting that CA alone
    (``https://`` addresses without it are checked against the system's CAs). ``rank``/``world_size`` default to torchrun's ``RANK``/``WORLD_SIZE``
    (else 0/1): with several ranks each saves its own part of the step and the checkpoint is
    complete once all parts are in. ``compress`` (a zstd level, e.g. 1) compresses chunks before
    they travel — float tensors split into exponent and mantissa byte planes — where a chunk
    shrinks by 5%; it pays when the network or the targets' disks are slower than this host's
    cores compress. Restores decode whatever was stored. ``warm`` (bytes, e.g. the size of this
    rank's state) allocates and pre-faults that much staging memory in the background now, so the
    first save's copy runs at memory speed instead of first-touch speed (see ``warm``).
    """

    def __init__(
        self,
        server: str | None = None,
        job: str | None = None,
        token: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        compress: int | None = None,
        warm: int | None = None,
        tls_ca: str | os.PathLike | None = None,
    ):
        self.server = server or os.environ.get("STARCKPT_SERVER") or DEFAULT_SERVER
        self.job = job or os.environ.get("STARCKPT_JOB") or None
        self.rank = _env_int("RANK", 0) if rank is None else rank
        self.world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
        if not (0 <= self.rank < self.world_size):
            raise InvalidInputError(f"rank {self.rank} is outside world size {self.world_size}")
        self._native = _native_client(
            self.server, compress, _bearer_token(token), os.fspath(tls_ca) if tls_ca is not None else None
        )
        self._closed = False
        self._in_flight: list[SaveHandle] = []
        #: This client's latest save, and whether a step of it was reported incomplete already.
        self._last_save: SaveHandle | None = None
        self._warned_incomplete = False
        if warm:
            self.warm(warm)

    # -- plumbing ---------------------------------------------------------------------------

    def _client(self) -> _native.NativeClient:
        if self._closed:
            raise ClosedError("this starckpt.Client is closed")
        return self._native

    def _job(self) -> str:
        if not self.job:
            raise InvalidInputError("no job: pass job= to starckpt.Client or set $STARCKPT_JOB")
        return self.job

    def _prefix(self, world_size: int, rank: int) -> str:
        return "" if world_size == 1 else f"rank{rank:05d}/"

    @property
    def run_id(self) -> str:
        """The training run this process writes for (decides the writer lease)."""
        return self._client().run_id

    # -- API --------------------------------------------------------------------------------

    def warm(self, nbytes: int, wait: bool = False) -> None:
        """Allocates and pre-faults up to `nbytes` of staging memory (at most the client's staging
        pool), in a background thread unless `wait`. Memory touched for the first time is copied
        into ~20x slower than memory touched before, so a first save into a cold pool blocks the
        trainer far longer than later ones; warming while the model trains removes that. The
        memory stays allocated for the saves that reuse it."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise InvalidInputError(f"nbytes must be a non-negative int, not {nbytes!r}")
        self._client().warm_staging(nbytes, wait)

    @property
    def staging_allocated_bytes(self) -> int:
        """Staging memory allocated (and pre-faulted) so far."""
        return self._client().staging_allocated_bytes

    def save(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        blocking: bool = False,
        skip_if_busy: bool = False,
    ) -> SaveHandle | None:
        """Saves this rank's `state` as (job, `step`). Returns once every array, tensor and bytes
        leaf is copied into staging buffers: the caller may change them right away. The handle
        resolves when the part is committed; with ``blocking=True`` this waits for that too.
        If this process's previous save is still uploading, this one first waits for it; with
        ``skip_if_busy=True`` it is skipped instead and None returned, so a trainer that saves
        more often than its saves upload never stalls (it saves a later step).

        A background save of this client that failed, and whose error no ``wait`` has raised
        yet, is raised here, before anything is saved (the exception's note names its step):
        a failed checkpoint is never silent. Catch it to go on saving; ``close`` raises the same,
        and a failure still unreported at interpreter exit is printed.

        With several ranks every rank saves each step (its own part); to save from one process
        alone, pass ``world_size=1``. A rank whose previous step is still not committed when it
        saves the next gets an ``IncompleteCheckpointWarning`` (once per client).

        `metadata` is a JSON-serialisable mapping stored with the part and returned by ``load``.
        """
        client = self._client()
        job = self._job()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidInputError(f"step must be a non-negative int, not {step!r}")
        self._raise_earlier_failure()
        self._warn_if_previous_incomplete(job)
        try:
            user_metadata = json.dumps(dict(metadata or {}), allow_nan=True)
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"metadata must be a JSON-serialisable mapping: {e}") from None
        prefix = self._prefix(self.world_size, self.rank)
        flat = _state.flatten(state, prefix)
        files = [*flat.files, (prefix + _state.TREE_FILE, _state.tree_json(flat))]
        native = client.save(
            job,
            step,
            files,
            rank=self.rank,
            world_size=self.world_size,
            metadata={_META_USER: user_metadata, _META_FORMAT: str(_state.FORMAT)},
            skip_if_busy=skip_if_busy,
        )
        if native is None:
            return None
        handle = SaveHandle(native, step)
        _track(handle)
        self._in_flight.append(handle)
        self._last_save = handle
        if blocking:
            handle.wait()
        return handle

    def _raise_earlier_failure(self) -> None:
        """Raises the first failed save of this client that nobody was told of (module docs of
        ``save``); forgets the others that finished."""
        failed, kept = None, []
        for h in self._in_flight:
            # Done read first: a save finishing meanwhile is kept, for the next call to judge.
            if not h.done():
                kept.append(h)
            elif h._failed_unreported():
                if failed is None:
                    failed = h
                else:
                    kept.append(h)
        self._in_flight = kept
        if failed is not None:
            try:
                failed.wait(0)
            except BaseException as e:
                note = f"starckpt: raised by a later call; the save of step {failed.step} failed in the background"
                e.add_note(note)
                raise

    def _warn_if_previous_incomplete(self, job: str) -> None:
        """Warns (once per client) when this rank's previous save put its part in but its step has
        still not committed: with several ranks, a step commits once every rank saved it, so a
        trainer that saves from rank 0 alone (with torchrun's ``WORLD_SIZE`` above 1) never
        commits anything, and finds nothing to resume from after a preemption."""
        previous = self._last_save
        if self._warned_incomplete or previous is None or self.world_size == 1 or not previous.done():
            return
        try:
            outcome = SaveOutcome(**previous._native.wait(0))
        except Exception:  # noqa: BLE001 - a failed save is raised by _raise_earlier_failure
            return
        if outcome.committed or outcome.world_size in (None, 1):
            return
        latest = self._client().latest(job)
        if latest is not None and latest >= outcome.step:
            return  # the other ranks' parts came in since
        self._warned_incomplete = True
        warnings.warn(
            f"starckpt: step {outcome.step} of {job} is not committed: {outcome.parts_committed} of "
            f"{outcome.world_size} parts were in when this rank's part finished, and the step is still "
            f"incomplete as rank {self.rank} saves the next. Every rank must save each step; to save "
            "from one process alone, pass world_size=1 (this client took its world size from "
            "WORLD_SIZE unless given one).",
            IncompleteCheckpointWarning,
            stacklevel=3,
        )

    def take_lease(self) -> int:
        """Takes this run's writer lease on the job now (the first save does otherwise) and
        returns its epoch. A resuming trainer calls it before it asks ``latest()``: from then on
        no writer of the preempted run can commit, so the step it resumes from stays the newest."""
        return self._client().lease(self._job())

    def latest(self) -> int | None:
        """The highest committed step of the job, or None: what to resume from."""
        return self._client().latest(self._job())

    def list(self, include_inactive: bool = False) -> list[dict[str, Any]]:
        """The job's checkpoints, oldest first (committed only, unless `include_inactive`)."""
        return self._client().list(self._job(), include_inactive)

    def load(self, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """This rank's state and metadata of `step` (default: the latest committed step), with the
        same structure, dtypes and shapes as saved. Tensors come back on the CPU. A checkpoint of
        several ranks loads only into a client of the same world size (its rank's shard); one
        saved by a single process loads into every rank."""
        manifest = self._manifest(step)
        world_size = manifest.world_size
        where = f"{manifest.job} step {manifest.step}"
        if world_size > 1 and world_size != self.world_size:
            # Rank r of another world size holds another shard: loading it would be wrong data.
            raise InvalidInputError(
                f"{where} was saved by {world_size} ranks, and this client is rank {self.rank} of "
                f"{self.world_size}: each rank's state is its own shard. Load with world_size={world_size} "
                "and the rank to read, or save with torch.distributed.checkpoint (starckpt.torch) to "
                "load under another world size"
            )
        rank = self.rank if world_size > 1 else 0
        tree_path = self._prefix(world_size, rank) + _state.TREE_FILE
        if manifest.size(tree_path) is None:
            raise FormatError(f"{where} has no {tree_path}: it was not written by starckpt.Client.save "
                              "(read its files with restore(), or starckpt.torch.Reader for DCP checkpoints)")
        sizes = dict(manifest.files())
        leaves, build = _state.plan_load(manifest.read(tree_path), sizes, where)
        manifest.read_many([(leaf.path, leaf.buffer, 0) for leaf in leaves])
        metadata: dict[str, Any] = {}
        for part_rank, part_metadata in manifest.metadata():
            if part_rank == rank and _META_USER in part_metadata:
                metadata = json.loads(part_metadata[_META_USER])
        return build(), metadata

    def restore(self, step: int | None = None, to: str | os.PathLike | None = None, force: bool = False) -> Path:
        """Writes every file of `step` (default: latest) under the directory `to`, verified; the
        tree appears there only once complete. Returns the directory. The latest deleted while it
        is restored (a newer one committed, and retention let it go) is given up for the new
        latest; a named step deleted meanwhile raises NotFoundError."""
        if to is None:
            raise InvalidInputError("restore needs a destination directory: to=...")
        destination = Path(to).absolute()
        self._client().restore(self._job(), str(destination), step, force)
        return destination

    def delete(self, step: int) -> None:
        """Deletes a committed checkpoint (its chunks are freed by the next garbage collection)."""
        self._client().delete(self._job(), step)

    def manifest(self, step: int | None = None) -> _native.Manifest:
        """The committed manifest of `step` (default: latest): file list and ranged reads."""
        return self._manifest(step)

    def _manifest(self, step: int | None) -> _native.Manifest:
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise InvalidInputError(f"step must be a non-negative int or None, not {step!r}")
        return self._client().manifest(self._job(), step)

    def close(self, wait: bool = True) -> None:
        """Closes this client; with `wait`, first waits for its saves in flight to commit (raising
        the first failure). The process's shared connection stays open for other clients."""
        if self._closed:
            return
        in_flight, self._in_flight = self._in_flight, []
        self._closed = True
        if wait:
            for handle in in_flight:
                handle.wait()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close(wait=exc_info[0] is None)

    def __repr__(self) -> str:
        return f"<starckpt.Client server={self.server!r} job={self.job!r} rank={self.rank}/{self.world_size}>"


__all__ = [
    "Client",
    "compress_chunk",
    "decompress_chunk",
    "SaveHandle",
    "SaveOutcome",
    "StarckptError",
    "ConnectionError",
    "NotFoundError",
    "AlreadyExistsError",
    "RejectedError",
    "FencedError",
    "DeniedError",
    "ChecksumError",
    "UnavailableError",
    "TargetError",
    "InvalidInputError",
    "UnsupportedTypeError",
    "FormatError",
    "StarckptIOError",
    "CancelledError",
    "ClosedError",
    "IncompleteCheckpointWarning",
]
