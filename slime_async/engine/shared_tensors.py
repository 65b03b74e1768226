"""SGLang's own `serialized_named_tensors` format: tensors travel as handles, not as bytes.

An item is base64 of a pickled list of (name, tensor) written by `ForkingPickler` with torch's
reductions (SGLang's `MultiprocessingSerializer.serialize(named, output_str=True)`). A CUDA tensor
pickles to a CUDA IPC handle of its memory, so an engine on the same GPU (the colocated layout)
copies the trainer's weights device to device, with no copy through the host or the HTTP body. A
CPU tensor pickles to the name of a shared-memory file (torch's `file_system` sharing strategy), so
the same path runs, and is tested, without a GPU.

The sender must keep the tensors alive until the engine answers: the engine copies them into its
own weights (and waits for that copy) before it replies.

Unpickling runs only the torch rebuild functions that this format needs: any other global in an
item is refused, as SGLang's `SafeUnpickler` does.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's tensor and storage reductions with ForkingPickler

_REBUILDERS = {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
               "rebuild_storage_empty", "rebuild_meta_tensor"}
_TORCH_NAMES = {"Tensor", "Size"}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        allowed = (
            (module == "torch.multiprocessing.reductions" and name in _REBUILDERS)
            or (module == "torch.storage" and name in {"UntypedStorage", "TypedStorage"})
            or (module == "torch" and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.nn.parameter" and name == "Parameter")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in shared tensors")
        return super().find_class(module, name)


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


def deserialize_shared(raw: bytes, index: int) -> dict[str, torch.Tensor]:
    """The tensors of one item; a ValueError names the item and what is wrong with it."""
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw)).load()
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
