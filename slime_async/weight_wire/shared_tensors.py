"""SGLang's own `serialized_named_tensors` format: tensors travel as handles, not as bytes.

An item is base64 of a pickled list of (name, tensor) written by `ForkingPickler` with torch's
reductions (SGLang's `MultiprocessingSerializer.serialize(named, output_str=True)`). A CUDA tensor
pickles to a CUDA IPC handle of its memory, so an engine on the same GPU (the colocated layout)
copies the trainer's weights device to device, with no copy through the host or the HTTP body. A
CPU tensor pickles to the name of a shared-memory file (torch's `file_system` sharing strategy), so
the same path runs, and is tested, without a GPU.

The sender must keep the tensors alive until the engine answers: the engine copies them into its
own weights (and waits for that copy) before it replies.

Unpickling runs only the torch rebuild functions that this format needs, each with its arguments
checked first (`_Rebuilders`): a handle must name an existing torch shared-memory file no smaller
than asked (never created or grown) through torch's own manager socket, within the engine's own
weight bytes; classes reach the pickle as names it cannot call. Any other global is refused, as
SGLang's `SafeUnpickler` does.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import re
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers torch's tensor and storage reductions with ForkingPickler
from torch.multiprocessing import reductions as _reductions


class _Class:
    """What a pickle gets for an allowed class: a name, not the class. Called directly, a class
    would allocate whatever the pickle asks (`UntypedStorage(10**9)`, `Tensor(...)`: a 13 KB item
    once took 1.6 GB and 23 s of CPU); only the rebuilders below turn it back into the class."""

    def __init__(self, cls: type) -> None:
        self.cls = cls


_CLASSES = {("torch", "Tensor"): torch.Tensor, ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
            ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
            ("torch.storage", "TypedStorage"): torch.TypedStorage}
_TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
_STORAGES = (torch.UntypedStorage, torch.TypedStorage)
_MANAGER = re.compile(rb"^/[^\0]*/torch-shm-dir-[A-Za-z0-9_]+/manager\.sock$")
"""torch's shared-memory manager socket (`file_system` strategy): the only socket a handle may name."""
_HANDLE = re.compile(rb"^/torch_\d+_\d+_\d+$")
"""A shared-memory file that torch made (`/dev/shm/torch_<pid>_<n>_<n>`)."""
MAX_DIMS = 8
_CLOCK_SLACK_S = 1.0
"""File times and `time.time()` are one clock on one host; this covers their rounding."""


class _Bad(pickle.UnpicklingError):
    pass


class _NotHere(OSError):
    """A well-formed handle of a file this host does not have: the item comes from another host."""


def _cls(value: object, allowed: tuple[type, ...]) -> type:
    if not isinstance(value, _Class) or value.cls not in allowed:
        raise _Bad(f"a rebuilder was given {type(value).__name__}, not one of {[c.__name__ for c in allowed]}")
    return value.cls


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list | torch.Size) or len(value) > MAX_DIMS or not all(
            isinstance(v, int) and v >= 0 for v in value):
        raise _Bad(f"{what}: expected at most {MAX_DIMS} non-negative ints")
    return tuple(value)


class _Rebuilders:
    """torch's rebuild functions with their arguments checked first; `budget` bounds the bytes of
    shared memory one item may map (the engine's own weights)."""

    def __init__(self, budget: int, since: float) -> None:
        self.budget = budget
        self.since = since

    def rebuild_tensor(self, cls: object, storage: object, metadata: object) -> torch.Tensor:
        if not isinstance(storage, _STORAGES) or not isinstance(metadata, tuple) or len(metadata) != 4:
            raise _Bad("rebuild_tensor: expected a storage and (offset, size, stride, requires_grad)")
        offset, size, stride, requires_grad = metadata
        if not isinstance(offset, int) or offset < 0:
            raise _Bad("rebuild_tensor: bad storage offset")
        _ints(size, "rebuild_tensor size"), _ints(stride, "rebuild_tensor stride")
        return _reductions.rebuild_tensor(_cls(cls, _TENSOR_CLASSES), storage,
                                          (offset, size, stride, bool(requires_grad)))

    def rebuild_typed_storage(self, storage: object, dtype: object) -> torch.TypedStorage:
        if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
            raise _Bad("rebuild_typed_storage: expected an untyped storage and a dtype")
        return _reductions.rebuild_typed_storage(storage, dtype)

    def rebuild_storage_filename(self, cls: object, manager: object, handle: object, size: object,
                                 dtype: object = None) -> Any:
        if not isinstance(manager, bytes) or not _MANAGER.match(manager):
            raise _Bad("rebuild_storage_filename: the manager is not torch's shared-memory manager socket")
        if not isinstance(handle, bytes) or not _HANDLE.match(handle):
            raise _Bad("rebuild_storage_filename: the handle is not a torch shared-memory file")
        if not isinstance(size, int) or size < 0 or (dtype is not None and not isinstance(dtype, torch.dtype)):
            raise _Bad("rebuild_storage_filename: bad size or dtype")
        nbytes = size * (torch._utils._element_size(dtype) if dtype is not None else 1)
        try:  # map only what exists, whole: never create or grow another process's file
            stat = os.stat("/dev/shm" + handle.decode())
        except OSError:
            raise _NotHere("rebuild_storage_filename: no such shared-memory file here") from None
        have = stat.st_size
        # made for this update: by this user (a root engine could otherwise read anyone's), since the
        # engine's last update (the trainer shares a fresh copy for each; another process's older file
        # is not one)
        if stat.st_uid != os.geteuid() or stat.st_mtime < self.since - _CLOCK_SLACK_S:
            raise _Bad("rebuild_storage_filename: the file was not made for this update (another user's, or "
                       "older than the engine's last update)")
        if nbytes > have or nbytes > self.budget:
            raise _Bad(f"rebuild_storage_filename: {nbytes} bytes asked, the file has {have}, the engine's "
                       f"weights {self.budget}")
        self.budget -= nbytes
        return _reductions.rebuild_storage_filename(_cls(cls, _STORAGES), manager, handle, size, dtype)

    def rebuild_storage_empty(self, cls: object) -> Any:
        return _reductions.rebuild_storage_empty(_cls(cls, _STORAGES))

    def rebuild_meta_tensor(self, cls: object, size: object, stride: object, offset: object, dtype: object,
                            storage_size_bytes: object, requires_grad: object) -> torch.Tensor:
        # no memory: shape only (the update is refused later, naming it)
        _ints(size, "rebuild_meta_tensor size"), _ints(stride, "rebuild_meta_tensor stride")
        if not isinstance(dtype, torch.dtype) or not isinstance(offset, int) or not isinstance(storage_size_bytes, int):
            raise _Bad("rebuild_meta_tensor: bad dtype, offset or storage size")
        return _reductions.rebuild_meta_tensor(_cls(cls, _TENSOR_CLASSES), size, stride, offset, dtype,
                                               storage_size_bytes, bool(requires_grad))

    def rebuild_cuda_tensor(self, cls: object, *args: Any) -> torch.Tensor:
        # CUDA IPC: the handle opens only memory another process exported to it
        if len(args) < 11 or not isinstance(args[3], _Class) or args[3].cls not in _STORAGES:
            raise _Bad("rebuild_cuda_tensor: unexpected arguments")
        args = (*args[:3], args[3].cls, *args[4:])
        return _reductions.rebuild_cuda_tensor(_cls(cls, _TENSOR_CLASSES), *args)


class _RestrictedUnpickler(pickle.Unpickler):
    """Only what this format needs: torch's rebuilders (checked, `_Rebuilders`), class names
    (`_Class`), dtypes and `torch.Size`; any other global is refused, as SGLang's `SafeUnpickler` does."""

    def __init__(self, file: io.BytesIO, budget: int, since: float) -> None:
        super().__init__(file)
        self.rebuilders = _Rebuilders(budget, since)

    def find_class(self, module: str, name: str) -> object:
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_") and hasattr(
                _Rebuilders, name):
            return getattr(self.rebuilders, name)
        if (module, name) in _CLASSES:
            return _Class(_CLASSES[(module, name)])
        if module == "torch" and name == "Size":
            return lambda dims: torch.Size(_ints(dims, "torch.Size"))
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in shared tensors")


def serialize_shared(named: list[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` item in SGLang's format. CPU tensors are first copied into
    shared memory (the caller's own tensors are left where they are); CUDA tensors are shared as
    they are."""
    if any(t.device.type == "cpu" for _, t in named):
        # the file_system strategy names a shared-memory file that any local process can open; the
        # default (file descriptors) only reaches processes this one started
        torch.multiprocessing.set_sharing_strategy("file_system")
    items = [(n, t.detach() if t.device.type == "cuda" else t.detach().clone()) for n, t in named]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def is_pickle(raw: bytes) -> bool:
    """Whether an item is a pickle (protocol 2 or later starts with PROTO) rather than a safetensors
    file (an 8-byte header length, then its JSON header)."""
    return raw[:1] == b"\x80" and raw[8:9] != b"{"


def deserialize_shared(raw: bytes, index: int, budget: int, since: float = 0.0) -> dict[str, torch.Tensor]:
    """The tensors of one item, mapping at most `budget` bytes of shared memory of files this user
    made since `since` (a Unix time); a ValueError names the item and what is wrong with it."""
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), budget, since).load()
    except pickle.UnpicklingError as exc:
        raise ValueError(f"serialized_named_tensors[{index}]: {exc}") from None
    except Exception as exc:  # a handle that cannot be opened here: another GPU, host or process gone
        raise ValueError(f"serialized_named_tensors[{index}]: cannot open shared tensors "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in obj):
        raise ValueError(f"serialized_named_tensors[{index}]: expected a list of (name, tensor) pairs")
    return dict(obj)
