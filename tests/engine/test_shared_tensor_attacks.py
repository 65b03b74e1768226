"""Pickled shared-tensor items (SGLang's format) built by an attacker who holds the admin token:
each is refused with the item named, and nothing is allocated, mapped, created or grown for it."""

from __future__ import annotations

import base64
import io
import os
import pickletools
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import reductions

from slime_async.weight_wire.shared_tensors import deserialize_shared, serialize_shared


class Call:
    """Pickles as a call of `fn(*args)`: what an attacker's item holds."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def item(*pairs: tuple[str, object]) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(pairs))
    return buf.getvalue()


def handle_of(named: list[tuple[str, torch.Tensor]]) -> tuple[bytes, bytes]:
    """(manager, handle) of a real item's shared-memory file, as the trainer writes them."""
    raw = base64.b64decode(serialize_shared(named))
    blobs = [arg for op, arg, _ in pickletools.genops(raw) if op.name in ("SHORT_BINBYTES", "BINBYTES")]
    return blobs[0], blobs[1]


def test_a_real_item_is_read() -> None:
    w = torch.randn(64, 64)
    raw = base64.b64decode(serialize_shared([("w", w)]))
    assert torch.equal(deserialize_shared(raw, 0, budget=w.numel() * 4)["w"], w)


@pytest.mark.parametrize(("payload", "message"), [
    # a class called directly would allocate what it is asked for
    (Call(torch.UntypedStorage, 10**10), "is not callable|not allowed|_Class"),
    (Call(torch.Tensor, 10**9), "is not callable|not allowed|_Class"),
    # an empty storage of the wrong class, a tensor over a storage it does not have
    (Call(reductions.rebuild_storage_empty, torch.nn.Parameter), "not one of"),
    (Call(reductions.rebuild_meta_tensor, torch.Tensor, (2,) * 9, (1,) * 9, 0, torch.float32, 0, False),
     "rebuild_meta_tensor size: expected at most 8"),
])  # fmt: skip
def test_calls_that_allocate_or_misuse_are_refused(payload: object, message: str) -> None:
    with pytest.raises(ValueError, match=r"serialized_named_tensors\[3\]"):
        deserialize_shared(item(("w", payload)), 3, budget=2**20)
    with pytest.raises(ValueError, match=message):
        deserialize_shared(item(("w", payload)), 3, budget=2**20)


def test_handles_that_would_reach_other_files_or_sockets_are_refused(tmp_path: Path) -> None:
    real = torch.randn(256)
    manager, handle = handle_of([("w", real)])
    size = real.numel() * 4
    before = os.stat("/dev/shm" + handle.decode()).st_size
    cases = {
        # any Unix socket but torch's manager
        (b"/run/some.sock", handle, size): "not torch's shared-memory manager socket",
        # any file but torch's shared memory
        (manager, b"/../../etc/shadow", size): "not a torch shared-memory file",
        # a file that is not there (it would be created)
        (manager, b"/torch_1_2_3", size): "no such shared-memory file here",
        # more than the file holds (it would be grown)
        (manager, handle, size * 1000): "bytes asked, the file has",
    }
    for (m, h, n), message in cases.items():
        payload = Call(reductions.rebuild_storage_filename, torch.UntypedStorage, m, h, n)
        with pytest.raises(ValueError, match=message):
            deserialize_shared(item(("w", payload)), 0, budget=2**30)
    assert os.stat("/dev/shm" + handle.decode()).st_size == before  # nothing grew it
    assert not os.path.exists("/dev/shm/torch_1_2_3")  # nothing made it


def test_the_budget_bounds_what_one_item_maps() -> None:
    w = torch.randn(1024)
    raw = base64.b64decode(serialize_shared([("w", w)]))
    with pytest.raises(ValueError, match="the engine's weights 100"):
        deserialize_shared(raw, 0, budget=100)


def test_a_file_older_than_the_last_update_is_not_opened() -> None:
    # a torch shared-memory file of another process (a vLLM's, an earlier update's) is not this one's
    w = torch.randn(128)
    raw = base64.b64decode(serialize_shared([("w", w)]))
    handle = [arg for op, arg, _ in pickletools.genops(raw) if op.name in ("SHORT_BINBYTES", "BINBYTES")][1]
    made = os.stat("/dev/shm" + handle.decode()).st_mtime
    with pytest.raises(ValueError, match="not made for this update"):
        deserialize_shared(raw, 0, budget=2**20, since=made + 60)  # the engine updated since
    assert torch.equal(deserialize_shared(raw, 0, budget=2**20, since=made)["w"], w)
