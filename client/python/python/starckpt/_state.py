"""Nested training state <-> files of a checkpoint part.

A state is a nested structure of dicts (any hashable scalar or tuple keys; ``OrderedDict`` kept),
lists and tuples whose leaves are numpy arrays and scalars, torch tensors (when torch is
installed), ``bytes``/``bytearray`` and plain Python values (``None``, bool, int, float, str).

Every array, tensor and bytes leaf becomes one file of the part, holding its raw bytes in C
order; the structure, dtypes and shapes go to ``<prefix>_starckpt/tree.json``. Plain values
live in the tree itself (floats as their 8 IEEE bytes, so NaN payloads, infinities and -0.0
round-trip; ints in hex, any size). dict subclasses other than ``OrderedDict`` come back as
dicts, tuple subclasses (namedtuples) as tuples. A tensor or array met again (the same memory,
dtype and shape: tied weights, which ``state_dict()`` lists under each name) is stored once and
comes back as one object under every name, as with ``torch.save``. Nothing is pickled: loading a
checkpoint never runs code from it, and its tree is checked against the part's files before any
memory is allocated for it.
"""

from __future__ import annotations

import collections
import json
import math
import re
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import FormatError, UnsupportedTypeError

FORMAT = 1
TREE_FILE = "_starckpt/tree.json"
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _torch():
    """The torch module if the caller has it (a state can only hold tensors if torch is imported)."""
    return sys.modules.get("torch")


@dataclass
class Flattened:
    """A state split into a JSON tree and the buffers of its leaves."""

    tree: Any
    # (path in the part, buffer exposing the leaf's bytes in C order)
    files: list[tuple[str, Any]] = field(default_factory=list)
    nbytes: int = 0


def _file_name(prefix: str, index: int, where: str) -> str:
    hint = _NAME_UNSAFE.sub("_", where).strip("._-")[:96]
    return f"{prefix}data/{index:06d}" + (f"-{hint}" if hint else "")


# Tensors on these devices are staged by a fill function (below) rather than as a host buffer.
# Tests add "cpu" to exercise that path without a GPU.
FILL_DEVICE_TYPES: set[str] = set()


def _host_bytes(tensor):
    """A uint8 numpy view of a contiguous CPU tensor's bytes. Through DLPack: ``Tensor.numpy()``
    would make the tensor's storage non-resizable for the rest of its life."""
    return np.from_dlpack(tensor.reshape(-1).view(_torch().uint8))


def tensor_source(tensor, where: str):
    """What ``_native.NativeClient.save`` takes for `tensor`'s bytes (C order): a uint8 numpy
    view of a host tensor (copied into staging, no copy before that when it is contiguous), or,
    for a tensor on an accelerator, ``(size, fill)``: ``fill(offset, view)`` copies that byte
    range device-to-host straight into the staging buffer ``view``, so no host copy is made."""
    torch = _torch()
    if tensor.is_sparse or tensor.is_quantized or tensor.layout != torch.strided:
        raise UnsupportedTypeError(f"{where}: {tensor.layout} / quantized tensors are not supported; save a dense copy")
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedTypeError(
            f"{where}: tensor subclass {type(tensor).__name__} is not supported by Client.save; "
            "save sharded state with torch.distributed.checkpoint and starckpt.torch.Writer"
        )
    data = tensor.detach().resolve_conj().resolve_neg()  # lazy conjugate/negative views, made real
    if data.device.type == "meta":
        raise UnsupportedTypeError(f"{where}: a meta tensor has no data to save")
    if data.device.type == "cpu" and "cpu" not in FILL_DEVICE_TYPES:
        return _host_bytes(data.contiguous())
    if data.device.type not in ("cpu", "cuda") and data.device.type not in FILL_DEVICE_TYPES:
        data = data.to("cpu")  # devices without a tested direct copy: one host copy first
        return _host_bytes(data.contiguous())
    flat = data.contiguous().reshape(-1).view(torch.uint8)  # on the device; a device copy if strided
    # The fills run on the SDK's copy threads, whose current stream is the device's default one,
    # which does not wait for the caller's (a side stream of the optimizer step, say; PyTorch's
    # pool streams do not synchronize with the default one). They copy on the caller's stream,
    # after what it queued: the step that wrote the tensor and the `contiguous` above.
    stream = torch.cuda.current_stream(data.device) if data.device.type == "cuda" else None

    def fill(offset: int, view) -> None:
        target = torch.frombuffer(view, dtype=torch.uint8)
        if stream is None:
            target.copy_(flat[offset : offset + target.numel()])
        else:
            with torch.cuda.stream(stream):
                target.copy_(flat[offset : offset + target.numel()])
        del target  # let go of `view` before returning

    return flat.numel(), fill


def source_nbytes(source) -> int:
    return source[0] if isinstance(source, tuple) else source.nbytes


def flatten(state: Any, prefix: str = "") -> Flattened:
    """Splits `state` into a tree and leaf buffers (files named under `prefix`)."""
    out = Flattened(tree=None)
    torch = _torch()
    # Leaves stored so far by identity of their memory: (kind, device, address, dtype, shape,
    # strides, ...) -> file. The values are kept alive by `state` itself.
    stored: dict[tuple, str] = {}

    def leaf_file(where: str, buffer, nbytes: int) -> str:
        name = _file_name(prefix, len(out.files), where)
        out.files.append((name, buffer))
        out.nbytes += nbytes
        return name

    def walk(value: Any, where: str) -> Any:
        if value is None:
            return {"t": "none"}
        if isinstance(value, bool):
            return {"t": "bool", "v": value}
        if type(value) is int:
            return {"t": "int", "v": hex(value)}  # no digit limit for base 16
        if type(value) is float:
            return {"t": "float", "v": struct.pack("<d", value).hex()}  # every bit, NaN payloads too
        if type(value) is str:
            return {"t": "str", "v": value}
        if isinstance(value, np.ndarray) or isinstance(value, np.generic):
            if isinstance(value, np.ma.MaskedArray):
                raise UnsupportedTypeError(f"{where}: masked arrays are not supported; save .data and .mask")
            array = np.asarray(value)
            if array.dtype.hasobject or array.dtype.kind == "V":
                raise UnsupportedTypeError(
                    f"{where}: numpy dtype {array.dtype} is not supported (object, structured or extension dtypes)"
                )
            key = None
            if isinstance(value, np.ndarray) and array.nbytes:
                address = array.__array_interface__["data"][0]
                key = ("ndarray", address, array.dtype.str, array.shape, array.strides)
                if key in stored:
                    return {"t": "ref", "f": stored[key]}
            contiguous = np.ascontiguousarray(array)
            node = {
                "t": "npscalar" if isinstance(value, np.generic) else "ndarray",
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "f": leaf_file(where, contiguous.reshape(-1).view(np.uint8), contiguous.nbytes),
            }
            if key is not None:
                stored[key] = node["f"]
            return node
        if isinstance(value, (bytes, bytearray)):
            kind = "bytes" if isinstance(value, bytes) else "bytearray"
            return {"t": kind, "f": leaf_file(where, value, len(value)), "n": len(value)}
        if torch is not None and isinstance(value, torch.Tensor):
            key = None
            plain = type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout == torch.strided
            # Only where memory has an address (an XLA or lazy tensor has no data pointer).
            if plain and not value.is_quantized and value.device.type in ("cpu", "cuda") and value.numel():
                key = (
                    "tensor", str(value.device), value.data_ptr(), value.dtype, tuple(value.shape), value.stride(),
                    isinstance(value, torch.nn.Parameter), bool(value.requires_grad), value.is_conj(), value.is_neg(),
                )
                if key in stored:
                    return {"t": "ref", "f": stored[key]}
            source = tensor_source(value, where)
            node = {
                "t": "tensor",
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
                "device": str(value.device),
                "requires_grad": bool(value.requires_grad),
                "param": isinstance(value, torch.nn.Parameter),
                "f": leaf_file(where, source, source_nbytes(source)),
            }
            if key is not None:
                stored[key] = node["f"]
            return node
        if isinstance(value, dict):
            keys, values = [], []
            for key, item in value.items():
                keys.append(walk_key(key, where))
                values.append(walk(item, f"{where}.{key}" if where else str(key)))
            if isinstance(value, collections.OrderedDict):
                node = {"t": "odict", "k": keys, "v": values}
                # A module's state_dict carries its submodules' versions here.
                if isinstance(getattr(value, "_metadata", None), dict):
                    node["m"] = walk(value._metadata, f"{where}._metadata")
                return node
            return {"t": "dict", "k": keys, "v": values}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {"t": kind, "v": [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]}
        raise UnsupportedTypeError(
            f"{where or 'state'}: cannot save a {type(value).__module__}.{type(value).__qualname__}; a state holds "
            "dicts, lists, tuples, numpy arrays, torch tensors, bytes, str, int, float, bool and None"
        )

    def walk_key(key: Any, where: str) -> Any:
        if key is None or isinstance(key, (bool, int, float, str)) or (
            isinstance(key, tuple) and all(k is None or isinstance(k, (bool, int, float, str)) for k in key)
        ):
            return walk(key, where)
        raise UnsupportedTypeError(f"{where or 'state'}: dict key {key!r} ({type(key).__name__}) is not supported")

    out.tree = walk(state, "")
    return out


def tree_json(flat: Flattened) -> bytes:
    return json.dumps({"format": FORMAT, "root": flat.tree}, separators=(",", ":")).encode()


@dataclass
class Leaf:
    """A leaf to read: its file, and the buffer to read it into."""

    path: str
    buffer: Any


def plan_load(document: bytes, sizes: dict[str, int], where: str):
    """Parses a tree document; returns (leaves to read, a function building the state once the
    leaves' buffers are filled). Every leaf is checked against its file's size in `sizes` before
    its memory is allocated; a malformed tree is a ``FormatError``."""
    try:
        parsed = json.loads(document)
    except ValueError as e:
        raise FormatError(f"{where}: {TREE_FILE} is not valid JSON: {e}") from None
    if not isinstance(parsed, dict) or parsed.get("format") != FORMAT:
        raise FormatError(f"{where}: {TREE_FILE} has format {parsed.get('format') if isinstance(parsed, dict) else '?'}, "
                          f"this SDK reads format {FORMAT}")
    leaves: list[Leaf] = []
    # Tensors and arrays by file: built once, so a reference to one gets the same object.
    built: dict[str, Any] = {}
    refs: dict[str, Any] = {}

    def sized(node: dict, nbytes: int) -> str:
        """The node's file, checked to hold `nbytes` (before anything is allocated for it)."""
        path = node["f"]
        if not isinstance(path, str) or sizes.get(path) != nbytes:
            raise FormatError(f"{where}: {path!r} is {sizes.get(path)} bytes, its tree entry says {nbytes}")
        return path

    def read_into(path: str, buffer: np.ndarray) -> None:
        """Queues the leaf's file to be read into `buffer` (a uint8 view of the value's memory)."""
        if buffer.nbytes:
            leaves.append(Leaf(path, buffer))

    def shape_of(node: dict) -> tuple[int, ...]:
        shape = node["shape"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FormatError(f"{where}: bad shape {shape!r:.80}")
        return tuple(shape)

    def once(path: str, make):
        """A thunk giving the value `make` builds, the same object every time it is asked, and
        what a reference to `path` gets."""
        def value():
            if path not in built:
                built[path] = make()
            return built[path]

        refs[path] = value
        return value

    def prepare(node: Any) -> Any:
        """Allocates buffers; returns a thunk producing the value."""
        if not isinstance(node, dict) or "t" not in node:
            raise FormatError(f"{where}: malformed tree node {node!r:.80}")
        try:
            return prepare_node(node)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RuntimeError, struct.error) as e:
            raise FormatError(f"{where}: malformed tree node {node!r:.80}: {type(e).__name__}: {e}") from None

    def prepare_node(node: dict) -> Any:
        kind = node["t"]
        if kind == "none":
            return lambda: None
        if kind in ("bool", "str"):
            value = node["v"]
            if not isinstance(value, bool if kind == "bool" else str):
                raise FormatError(f"{where}: a {kind} node holds {value!r:.80}")
            return lambda: value
        if kind == "int":
            value = int(node["v"], 16)
            return lambda: value
        if kind == "float":
            value = struct.unpack("<d", bytes.fromhex(node["v"]))[0]
            return lambda: value
        if kind in ("bytes", "bytearray"):
            n = node["n"]
            if type(n) is not int:
                raise FormatError(f"{where}: bad length {n!r:.80}")
            path = sized(node, n)
            data = bytearray(n)
            read_into(path, np.frombuffer(data, dtype=np.uint8))
            return (lambda: bytes(data)) if kind == "bytes" else (lambda: data)
        if kind in ("ndarray", "npscalar"):
            try:
                dtype = np.dtype(node["dtype"])
            except TypeError:
                raise FormatError(f"{where}: unknown numpy dtype {node['dtype']!r}") from None
            if dtype.hasobject:
                raise FormatError(f"{where}: numpy dtype {dtype} holds Python objects")
            shape = shape_of(node)
            path = sized(node, math.prod(shape) * dtype.itemsize)
            array = np.empty(shape, dtype=dtype)
            read_into(path, array.reshape(-1).view(np.uint8))
            if kind == "npscalar":
                return lambda: array[()]
            return once(path, lambda: array)
        if kind == "tensor":
            return prepare_tensor(node)
        if kind == "ref":
            path = node["f"]
            if not isinstance(path, str) or path not in refs:
                raise FormatError(f"{where}: a reference to {path!r:.80}, which no earlier tensor or array stored")
            return refs[path]
        if kind in ("dict", "odict"):
            if len(node["k"]) != len(node["v"]):
                raise FormatError(f"{where}: a dict node of {len(node['k'])} keys and {len(node['v'])} values")
            for key in node["k"]:
                check_key(key)
            keys = [prepare(k) for k in node["k"]]
            values = [prepare(v) for v in node["v"]]
            if kind == "dict":
                return lambda: dict((k(), v()) for k, v in zip(keys, values))
            metadata = prepare(node["m"]) if "m" in node else None

            def build_odict():
                result = collections.OrderedDict((k(), v()) for k, v in zip(keys, values))
                if metadata is not None:
                    result._metadata = metadata()
                return result

            return build_odict
        if kind in ("list", "tuple"):
            if not isinstance(node["v"], list):
                raise FormatError(f"{where}: a {kind} node without a list of items")
            items = [prepare(v) for v in node["v"]]
            cls = list if kind == "list" else tuple
            return lambda: cls(item() for item in items)
        raise FormatError(f"{where}: unknown tree node type {kind!r}")

    def check_key(node: Any) -> None:
        """A dict key is what ``flatten`` saves as one: a plain scalar, or a tuple of them."""
        scalars = ("none", "bool", "int", "float", "str", "npscalar")
        kind = node.get("t") if isinstance(node, dict) else None
        items = node.get("v") if kind == "tuple" else None
        if kind in scalars or (
            isinstance(items, list) and all(isinstance(i, dict) and i.get("t") in scalars for i in items)
        ):
            return
        raise FormatError(f"{where}: a dict key that is not a scalar or a tuple of scalars: {node!r:.80}")

    def prepare_tensor(node: dict):
        try:
            import torch
        except ImportError:
            raise FormatError(f"{where}: the checkpoint holds torch tensors; install torch to load it") from None
        dtype = getattr(torch, node["dtype"], None) if isinstance(node["dtype"], str) else None
        if not isinstance(dtype, torch.dtype):
            raise FormatError(f"{where}: unknown torch dtype {node['dtype']!r}")
        shape = shape_of(node)
        path = sized(node, math.prod(shape) * dtype.itemsize)
        tensor = torch.empty(shape, dtype=dtype)
        if tensor.numel():
            read_into(path, _host_bytes(tensor))

        def build():
            if node.get("param"):
                return torch.nn.Parameter(tensor, requires_grad=bool(node.get("requires_grad")))
            if node.get("requires_grad") and (dtype.is_floating_point or dtype.is_complex):
                tensor.requires_grad_(True)
            return tensor

        return once(path, build)

    build = prepare(parsed.get("root"))
    return leaves, build
