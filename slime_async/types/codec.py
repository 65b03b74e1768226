"""msgpack (wire) and JSON (files) encodings of the Structs in `types.core`.

The transport frames and acknowledges these bytes; this module only says what the bytes are.
A frame written by a newer schema is rejected before its body is read, with an error that says
so, rather than being half-understood.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from slime_async.types.arrays import (
    json_dec_hook,
    json_enc_hook,
    msgpack_dec_hook,
    msgpack_enc_hook,
    msgpack_ext_hook,
)
from slime_async.types.core import SCHEMA_VERSION

T = TypeVar("T")


class DecodeError(ValueError):
    """A frame or line that cannot be read as the expected Struct; the message says where."""


class SchemaVersionError(DecodeError):
    """A frame from a newer schema version than this reader understands."""


class _Header(msgspec.Struct):
    """Just enough of a frame to check its schema version; msgspec skips every other field."""

    schema_version: int = SCHEMA_VERSION


_header_decoder = msgspec.msgpack.Decoder(_Header)
_json_header_decoder = msgspec.json.Decoder(_Header)
_msgpack_encoder = msgspec.msgpack.Encoder(enc_hook=msgpack_enc_hook)
_json_encoder = msgspec.json.Encoder(enc_hook=json_enc_hook)
_msgpack_decoders: dict[Any, msgspec.msgpack.Decoder] = {}
_json_decoders: dict[Any, msgspec.json.Decoder] = {}


def to_msgpack(obj: Any) -> bytes:
    """Encode a Struct (or a list of them) as a msgpack frame, arrays as raw bytes."""
    return _msgpack_encoder.encode(obj)


def from_msgpack(data: bytes | memoryview, type: type[T]) -> T:
    """Decode a msgpack frame as `type`, checking its schema version first.

    Arrays in the result are read-only views of `data` (no copy): they keep `data` alive, and a
    caller that passes a mutable buffer must not change it afterwards."""
    _check_schema(data, _header_decoder.decode, "msgpack")
    decoder = _msgpack_decoders.get(type)
    if decoder is None:
        decoder = _msgpack_decoders[type] = msgspec.msgpack.Decoder(
            type, dec_hook=msgpack_dec_hook, ext_hook=msgpack_ext_hook
        )
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"invalid {getattr(type, '__name__', type)} frame: {exc}") from None


def to_json(obj: Any) -> bytes:
    """Encode a Struct as one line of JSON (arrays as lists), without the newline."""
    return _json_encoder.encode(obj)


def from_json(data: bytes | str, type: type[T]) -> T:
    """Decode one JSON document as `type`, checking its schema version first."""
    _check_schema(data, _json_header_decoder.decode, "JSON")
    decoder = _json_decoders.get(type)
    if decoder is None:
        decoder = _json_decoders[type] = msgspec.json.Decoder(type, dec_hook=json_dec_hook)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"invalid {getattr(type, '__name__', type)} JSON: {exc}") from None


def _check_schema(data: Any, decode_header: Any, fmt: str) -> None:
    try:
        header = decode_header(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # not a single Struct (a list, say) or not valid at all: the full decode says why
    if header.schema_version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{fmt} frame has schema version {header.schema_version}, newer than this reader's "
            f"{SCHEMA_VERSION}: upgrade slime_async on this side"
        )
