"""PyTorch integration: one-call save/load of a trainer's state, and a
``torch.distributed.checkpoint`` (DCP) storage writer and reader.

One call for model, optimizer and RNG::

    starckpt.torch.save({"model": model, "optimizer": opt, "epoch": 3}, step)   # async
    state = starckpt.torch.load({"model": model, "optimizer": opt})             # latest

DCP, synchronous, asynchronous, any world size::

    import torch.distributed.checkpoint as dcp
    dcp.save(sd, storage_writer=starckpt.torch.Writer(job="llama", step=step))
    future = dcp.async_save(sd, storage_writer=starckpt.torch.Writer(job="llama", step=step))
    dcp.load(sd, storage_reader=starckpt.torch.Reader(job="llama"))            # latest

How DCP maps onto starckpt's multi-rank commit: with W ranks, each rank's data is one part of the
checkpoint (rank r, committed when its ``write_data`` finishes) and DCP's metadata is one more
part (rank W, written by the coordinator in ``finish``), so the checkpoint has W + 1 parts and is
complete, and visible to ``latest``, only once every rank's data and the metadata are in. With
one process the data and the metadata go in a single part committed by ``finish``. Each tensor is
stored as its raw bytes (no pickling of tensors); the metadata is DCP's pickled ``Metadata``, as
with ``FileSystemWriter``, but the Reader unpickles it allowing only the classes and torch values
DCP's metadata is made of, so loading a checkpoint runs no code from it (a custom planner that puts
its own classes in the metadata names them with ``Reader(metadata_globals=...)``). Loading with a
different world size works: DCP plans which saved chunks each rank needs; the reader serves those
files.

Ranks of one checkpoint must share a run id (torchrun's ``TORCHELASTIC_RUN_ID`` or
``STARCKPT_RUN_ID``); every Writer and Reader of a process shares its one connection and lease.
(``async_save`` with ``AsyncCheckpointerType.PROCESS`` saves from another process: give it the
trainer's run id through ``STARCKPT_RUN_ID``, or it is a new run that fences the trainer.)
DCP's collective save is required (``use_collectives=True``, the default). Tensors on a GPU are
copied device-to-host straight into the SDK's staging buffers. A Reader fetches only the rows of
a stored tensor that its rank's plan needs when the plan slices dim 0 (resharding along dim 0),
and the whole item otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import math
import os
import pickle
import random
import uuid
from typing import Any, Iterable, Mapping

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    LoadItemType,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import Client, SaveHandle, _native_client, _state
from .errors import FormatError, InvalidInputError, StarckptError

SCHEME = "starckpt://"
METADATA_FILE = "dcp/.metadata"
_RNG_KEY = "__starckpt_rng__"
# Bytes a Reader holds in read buffers at once (per rank).
READ_BATCH_BYTES = 1 << 30


# -- one-call save/load -------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(value: Any) -> Any:
    """`value`'s state dict if it has one (module, optimizer, scheduler), else `value`."""
    return value.state_dict() if callable(getattr(value, "state_dict", None)) else value


def save(
    state: Mapping[str, Any],
    step: int,
    *,
    job: str | None = None,
    server: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    rng: bool = True,
    blocking: bool = False,
) -> SaveHandle:
    """Saves `state` (a mapping whose values may be modules, optimizers or schedulers, saved by
    their ``state_dict()``, or any value ``starckpt.Client.save`` takes) as `step`, plus the
    Python, numpy, torch and CUDA RNG states when `rng`. Returns once staged (see Client.save)."""
    if not isinstance(state, Mapping):
        raise InvalidInputError(f"state must be a mapping, not {type(state).__name__}")
    if _RNG_KEY in state:
        raise InvalidInputError(f"{_RNG_KEY!r} is reserved")
    plain = {key: _plain(value) for key, value in state.items()}
    if rng:
        plain[_RNG_KEY] = _rng_state()
    return Client(server, job).save(step, plain, metadata=metadata, blocking=blocking)


def load(
    into: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    job: str | None = None,
    server: str | None = None,
    rng: bool = True,
) -> dict[str, Any]:
    """Loads `step` (default: the latest committed step) and returns its state. Objects in `into`
    with ``load_state_dict`` (modules, optimizers, schedulers) get their saved state loaded; with
    `rng` the RNG states saved with it are restored. Raises NotFoundError when there is none."""
    loaded, _ = Client(server, job).load(step)
    if not isinstance(loaded, dict):
        raise FormatError("the checkpoint was not written by starckpt.torch.save")
    rng_state = loaded.pop(_RNG_KEY, None)
    for key, target in (into or {}).items():
        if key not in loaded:
            raise FormatError(f"the checkpoint has no {key!r} to load (it has {sorted(map(str, loaded))})")
        if callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(loaded[key])
    if rng and rng_state is not None:
        _set_rng_state(rng_state)
    return loaded


# -- DCP ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StorageInfo:
    """Where one DCP write item lives: a file of the checkpoint holding its raw bytes."""

    path: str
    length: int
    #: torch dtype name and shape of a tensor item; None for a bytes item.
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


def parse_checkpoint_id(checkpoint_id: str | os.PathLike) -> tuple[str, int | None]:
    """``starckpt://<job>/<step>`` (or ``starckpt://<job>`` for the latest) -> (job, step). The
    job may be an operator's name of a tenant's job, ``<tenant>/<name>``: the step is the last
    part, when it is a number."""
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or not text.startswith(SCHEME):
        raise InvalidInputError(f"checkpoint id {text!r} is not {SCHEME}<job>[/<step>]")
    rest = text[len(SCHEME) :]
    job, _, step = rest.rpartition("/")
    if not (job and step.isdigit()):
        job, step = rest, ""
    if not job or job.endswith("/"):
        raise InvalidInputError(f"checkpoint id {text!r} is not {SCHEME}<job>[/<step>]")
    return job, int(step) if step else None


def _parses(checkpoint_id: str | os.PathLike, need_step: bool) -> bool:
    try:
        return not need_step or parse_checkpoint_id(checkpoint_id)[1] is not None
    except InvalidInputError:
        return False


class _Addressed:
    """What a Writer or Reader points at: a server, a job and a step (None: the latest)."""

    def _address(self, job: str | None, step: int | None, server: str | None) -> None:
        self.server = server or os.environ.get("STARCKPT_SERVER") or None
        self.job = job or os.environ.get("STARCKPT_JOB") or None
        self.step = step

    def _readdress(self, checkpoint_id: str | os.PathLike | None) -> None:
        if checkpoint_id:
            self.job, self.step = parse_checkpoint_id(checkpoint_id)


@dataclasses.dataclass(frozen=True)
class _Part:
    """A rank's part of a DCP save: set by the coordinator's global plan."""

    rank: int
    ranks: int


class Writer(StorageWriter, _Addressed):
    """A DCP StorageWriter saving into starckpt checkpoint (`job`, `step`).

    `job` defaults to ``$STARCKPT_JOB``; either may come from ``checkpoint_id=
    "starckpt://<job>/<step>"`` given to ``dcp.save`` instead.
    """

    def __init__(self, job: str | None = None, step: int | None = None, *, server: str | None = None):
        super().__init__()
        self._address(job, step, server)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = True
        # Single process: the data files wait here for finish(), which commits them with the
        # metadata in one part.
        self._pending: list[tuple[str, Any]] = []

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _parses(checkpoint_id, need_step=True)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._readdress(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._pending = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            # Then every rank would run finish() with metadata of its own items only, and the
            # checkpoint would complete with the first of them.
            raise InvalidInputError("starckpt.torch.Writer needs DCP's collective save (use_collectives=True)")
        self.is_coordinator = is_coordinator
        self._check_step()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{SCHEME}{self.job}/{self.step}", save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The ranks of *this* save (its process group, or one with no_dist), not the default
        # group: each rank learns its part and the part count from its plan.
        return [dataclasses.replace(plan, storage_data=_Part(rank, len(plans))) for rank, plan in enumerate(plans)]

    def _check_step(self) -> None:
        if self.step is None or not isinstance(self.step, int) or self.step < 0:
            raise InvalidInputError("starckpt.torch.Writer needs a step: Writer(job, step) or checkpoint_id=starckpt://job/step")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        part = plan.storage_data
        if not isinstance(part, _Part):
            raise InvalidInputError("starckpt.torch.Writer got a plan without its part: DCP skipped prepare_global_plan")
        files: list[tuple[str, Any]] = []
        results: list[WriteResult] = []
        for index, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            path = f"dcp/__{part.rank}_{index}"
            if item.type == WriteItemType.BYTE_IO:
                buffer = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
                info = StorageInfo(path, _state.source_nbytes(buffer))
            else:
                tensor = data.detach()
                buffer = _state.tensor_source(tensor, f"{item.index.fqn}")
                dtype = str(tensor.dtype).removeprefix("torch.")
                info = StorageInfo(path, _state.source_nbytes(buffer), dtype, tuple(tensor.shape))
            files.append((path, buffer))
            results.append(WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info))
        if part.ranks == 1:
            self._pending = files
        else:
            self._save(files, rank=part.rank, parts=part.ranks + 1)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        files = [*self._pending, (METADATA_FILE, pickle.dumps(metadata))]
        self._pending = []
        ranks = len(results)
        outcome = self._save(files, rank=ranks if ranks > 1 else 0, parts=ranks + 1 if ranks > 1 else 1)
        if not outcome["committed"]:
            raise StarckptError(
                f"{self.job} step {self.step}: the metadata part did not complete the checkpoint "
                f"({outcome['parts_committed']} of {outcome['world_size']} parts in)"
            )

    def _save(self, files: list[tuple[str, Any]], rank: int, parts: int) -> dict[str, Any]:
        self._check_step()
        client = Client(self.server, self.job, rank=rank, world_size=parts)
        native = client._client().save(client._job(), self.step, files, rank=rank, world_size=parts)
        return native.wait()


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata allowing only the globals it is made of: DCP's metadata classes,
    torch dtypes, layouts, memory formats and ``Size``, this module's ``StorageInfo``, and the
    reader's ``extra`` (module, name) pairs. Anything else (a function to call, an arbitrary
    class) is refused before it is imported."""

    _CLASSES_OF = ("torch.distributed.checkpoint.metadata",)
    _NAMED = frozenset({
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        (__name__, "StorageInfo"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    })

    def __init__(self, file: io.BytesIO, extra: frozenset[tuple[str, str]]):
        super().__init__(file)
        self._extra = extra

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._NAMED or (module, name) in self._extra:
            return super().find_class(module, name)
        # Plain names only: a dotted one walks attributes (``Metadata.__init__.__globals__``).
        if "." not in name:
            if module in self._CLASSES_OF:
                found = getattr(importlib.import_module(module), name, None)
                # Its own classes, not what it imports (``typing.Any``, ``enum.Enum``).
                if isinstance(found, type) and found.__module__ == module:
                    return found
            if module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
            ):
                return getattr(torch, name)
        raise FormatError(
            f"{METADATA_FILE} refers to {module}.{name}, which DCP metadata does not use; "
            "a custom planner's own classes must be named with Reader(metadata_globals=...)"
        )


class Reader(StorageReader, _Addressed):
    """A DCP StorageReader loading starckpt checkpoint (`job`, `step`); `step` None means the
    latest committed one (pinned when the metadata is read, so every rank reads the same step)."""

    def __init__(
        self,
        job: str | None = None,
        step: int | None = None,
        *,
        server: str | None = None,
        metadata_globals: Iterable[tuple[str, str]] = (),
    ):
        super().__init__()
        self._address(job, step, server)
        self._metadata_globals = frozenset(metadata_globals)
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, StorageInfo] = {}
        self._manifest = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _parses(checkpoint_id, need_step=False)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._readdress(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.storage_data = {}
        self._manifest = None

    def _fetch_manifest(self, step: int | None):
        client = Client(self.server, self.job, rank=0, world_size=1)
        return client.manifest(step)

    def read_metadata(self, *args: Any) -> Metadata:
        # No **kwargs on purpose: DCP would then retry a failed read per rank, without
        # collectives, and a rank that failed alone would wait forever for the others.
        manifest = self._fetch_manifest(self.step)
        if manifest.size(METADATA_FILE) is None:
            raise FormatError(f"{manifest.job} step {manifest.step} has no {METADATA_FILE}: it is not a DCP checkpoint")
        metadata = _MetadataUnpickler(io.BytesIO(manifest.read(METADATA_FILE)), self._metadata_globals).load()
        if not isinstance(metadata, Metadata):
            raise FormatError(f"{manifest.job} step {manifest.step}: {METADATA_FILE} is not DCP metadata")
        self._manifest = manifest
        metadata.storage_meta = StorageMeta(
            checkpoint_id=f"{SCHEME}{manifest.job}/{manifest.step}", load_id=self.load_id
        )
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        checkpoint_id = metadata.storage_meta.checkpoint_id if metadata.storage_meta else None
        if checkpoint_id:
            job, step = parse_checkpoint_id(checkpoint_id)
            if self._manifest is None or (self._manifest.job, self._manifest.step) != (job, step):
                self.job, self.step = job, step
                self._manifest = self._fetch_manifest(step)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._manifest is None:
            self._manifest = self._fetch_manifest(self.step)
        return dataclasses.replace(plan, storage_data=(self._manifest.job, self._manifest.step))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        read = sorted({plan.storage_data for plan in plans}, key=repr)
        if len(read) > 1:
            # "Latest" moved while the ranks looked it up: they would load different steps.
            raise FormatError(f"the ranks resolved different checkpoints {read}; load again, or pass step=")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._manifest is None:
            self._manifest = self._fetch_manifest(self.step)
        by_file: dict[str, list] = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if not isinstance(info, StorageInfo):
                raise FormatError(f"no starckpt storage entry for {item.storage_index}")
            by_file.setdefault(info.path, []).append(item)
        batch: list[tuple[StorageInfo, _Rows, np.ndarray]] = []
        batch_bytes = 0
        for path, items in by_file.items():
            info = self.storage_data[items[0].storage_index]
            _check_entry(info, self._manifest.size(info.path))
            rows = _rows_needed(info, items)
            if batch and batch_bytes + rows.nbytes > READ_BATCH_BYTES:
                self._apply(batch, by_file, planner)
                batch, batch_bytes = [], 0
            batch.append((info, rows, np.empty(rows.nbytes, dtype=np.uint8)))
            batch_bytes += rows.nbytes
        if batch:
            self._apply(batch, by_file, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _apply(self, batch, by_file, planner: LoadPlanner) -> None:
        self._manifest.read_many([(info.path, buffer, rows.offset) for info, rows, buffer in batch if rows.nbytes])
        for info, rows, buffer in batch:
            for item in by_file[info.path]:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(buffer.tobytes()))
                    continue
                dtype = getattr(torch, info.dtype or "", None)
                if not isinstance(dtype, torch.dtype) or info.shape is None:
                    raise FormatError(f"{info.path}: bad tensor entry {info}")
                shape = rows.shape(info.shape)
                if rows.nbytes:
                    tensor = torch.from_numpy(buffer).view(dtype).reshape(shape)
                else:
                    tensor = torch.empty(shape, dtype=dtype)
                offsets = list(item.storage_offsets)
                if offsets:
                    offsets[0] -= rows.first
                tensor = _narrow(tensor, offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise FormatError(f"{item.storage_index}: stored {tuple(tensor.size())}, asked for {tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(item, target)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The part of a stored item a rank reads: rows [first, first + count) of dim 0 (all of it
    unless every request narrows dim 0 only, as resharding along dim 0 does)."""

    first: int
    count: int | None  # None: the whole file (bytes items, 0-d tensors)
    row_bytes: int
    total: int

    @property
    def offset(self) -> int:
        return self.first * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.total if self.count is None else self.count * self.row_bytes

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(stored) if self.count is None else (self.count, *stored[1:])


def _check_entry(info: StorageInfo, stored: int | None) -> None:
    """Refuses a storage entry of the metadata that does not describe its file, before anything
    is allocated for it: its length is the file's, and a tensor's is its dtype times its shape."""
    if stored is None:
        raise FormatError(f"{info.path!r}: named by the DCP metadata, and not a file of the checkpoint")
    if type(info.length) is not int or info.length != stored:
        raise FormatError(f"{info.path!r}: the DCP metadata says {info.length!r} bytes, the checkpoint holds {stored}")
    if info.dtype is None and info.shape is None:
        return
    dtype = getattr(torch, info.dtype, None) if isinstance(info.dtype, str) else None
    shape = info.shape
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, (tuple, list, torch.Size)) or not all(
        type(d) is int and d >= 0 for d in shape
    ):
        raise FormatError(f"{info.path!r}: bad tensor entry {info}")
    if math.prod(shape) * dtype.itemsize != info.length:
        raise FormatError(f"{info.path!r}: a {info.dtype} tensor of shape {tuple(shape)} is not {info.length} bytes")


def _rows_needed(info: StorageInfo, items) -> _Rows:
    whole = _Rows(0, None, 0, info.length)
    if not info.shape or info.dtype is None or any(item.type == LoadItemType.BYTE_IO for item in items):
        return whole
    shape = tuple(info.shape)
    row_bytes = info.length // shape[0] if shape[0] else 0
    first, end = shape[0], 0
    for item in items:
        rest = zip(item.storage_offsets[1:], item.lengths[1:], shape[1:])
        if len(item.storage_offsets) != len(shape) or any(o != 0 or n != size for o, n, size in rest):
            return whole
        first, end = min(first, item.storage_offsets[0]), max(end, item.storage_offsets[0] + item.lengths[0])
    if not row_bytes or first >= end:
        return whole
    return _Rows(first, end - first, row_bytes, info.length)


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


__all__ = ["save", "load", "Writer", "Reader", "StorageInfo", "parse_checkpoint_id"]
