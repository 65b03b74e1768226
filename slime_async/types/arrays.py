"""Per-token arrays and how they cross the wire.

Token ids, logprobs, weight versions and loss masks are numpy arrays in memory and raw
little-endian bytes on the wire (a msgpack extension whose code names the dtype). Python lists
of ints are about 4x slower through msgpack (docs/measured.md), and every trajectory carries
thousands of tokens, so this is the hot path of the whole data flow.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

# dtype of each kind of per-token array; fixed so that every part reads the same bytes.
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
VERSION_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
ROUTE16_DTYPE = np.dtype("<i2")
"""Routed-expert ids of models with 255 experts or more (`slime_async.moe.routing`; fewer use uint8)."""

# msgpack extension codes, one per dtype. Codes are part of the wire format: never reuse one.
_EXT_CODE_BY_DTYPE: dict[np.dtype, int] = {TOKEN_DTYPE: 1, LOGPROB_DTYPE: 2, MASK_DTYPE: 3, ROUTE16_DTYPE: 4}
_DTYPE_BY_EXT_CODE: dict[int, np.dtype] = {code: dt for dt, code in _EXT_CODE_BY_DTYPE.items()}


def as_array(values: Any, dtype: np.dtype, field: str) -> np.ndarray:
    """Return `values` as a 1-D array of `dtype`, converting lists; name `field` if it cannot."""
    if isinstance(values, np.ndarray) and values.dtype == dtype and values.ndim == 1:
        return values
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{field}: not an array of numbers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{field}: expected a 1-D array, got shape {arr.shape}")
    if arr.size and dtype.kind in "iu" and arr.dtype.kind == "f":
        raise ValueError(f"{field}: expected integers, got {arr.dtype}")
    if arr.size and dtype.kind in "iu" and arr.dtype.kind in "iu":
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise ValueError(f"{field}: values outside the range of {dtype} ({info.min}..{info.max})")
    return arr.astype(dtype, copy=False)


def msgpack_enc_hook(obj: Any) -> Any:
    """msgspec encoder hook: numpy arrays become extension objects holding their raw bytes."""
    if isinstance(obj, np.ndarray):
        code = _EXT_CODE_BY_DTYPE.get(obj.dtype)
        if code is None:
            raise TypeError(f"no wire encoding for arrays of dtype {obj.dtype}")
        return msgspec.msgpack.Ext(code, np.ascontiguousarray(obj).tobytes())
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


def msgpack_ext_hook(code: int, data: memoryview) -> Any:
    """msgspec extension hook: an array extension becomes a read-only array over the frame itself.

    `data` is a view of the frame being decoded, so the array shares its memory (no copy of ~50 kB
    per trajectory, and a decoded trajectory costs no more memory than its frame, which the buffer
    keeps anyway). Anything not a well-formed array stays an Ext, so that `msgpack_dec_hook` raises
    for it with the field's path in the error."""
    dtype = _DTYPE_BY_EXT_CODE.get(code)
    if dtype is None or len(data) % dtype.itemsize:
        return msgspec.msgpack.Ext(code, bytes(data))
    return np.frombuffer(data, dtype=dtype)


def msgpack_dec_hook(tp: type, obj: Any) -> Any:
    """msgspec decoder hook: arrays (from `msgpack_ext_hook`) pass, lists become arrays, the rest is an error."""
    if tp is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        if isinstance(obj, msgspec.msgpack.Ext):
            dtype = _DTYPE_BY_EXT_CODE.get(obj.code)
            if dtype is None:
                raise ValueError(f"unknown array extension code {obj.code}")
            if len(obj.data) % dtype.itemsize:
                raise ValueError(f"array of {dtype} has {len(obj.data)} bytes, not a whole number of items")
            return np.frombuffer(obj.data, dtype=dtype)
        if isinstance(obj, list):  # tolerated for hand-written frames; the struct fixes the dtype
            return np.asarray(obj)
    raise NotImplementedError(f"cannot decode {type(obj).__name__} as {tp}")


def json_enc_hook(obj: Any) -> Any:
    """msgspec JSON encoder hook: arrays become lists (JSONL files are for people and tools)."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


def json_dec_hook(tp: type, obj: Any) -> Any:
    """msgspec JSON decoder hook: lists become arrays; the struct then fixes the dtype."""
    if tp is np.ndarray and isinstance(obj, list):
        return np.asarray(obj)
    raise NotImplementedError(f"cannot decode {type(obj).__name__} as {tp}")
