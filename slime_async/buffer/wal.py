"""The buffer's write-ahead log: one append-only file of length-prefixed, checksummed records.

Every change of the buffer's state is appended here before anyone is told about it: a trajectory
before its ack goes to the sender, a delivery before the batch goes to the trainer. A restarted
buffer replays the file and is back where it was. Compaction rewrites the file as one snapshot
of what is still live (atomically: a temporary file, fsync, rename), dropping trained trajectories.

Group commit: the server appends every record of one step (up to ~2 MiB of messages from all
senders) and `commit` hands them to the OS in one writev, before any of them is acked. What survives:
- the buffer process killed (kill -9, OOM, crash): every acked trajectory, always (the kernel has
  the bytes once writev returns; the page cache outlives the process);
- power loss or a kernel crash: only with `buffer.wal_fsync` (one fsync per commit, so per step, not
  per trajectory); without it, up to the last few seconds of acked trajectories can be lost, which
  the senders cannot resend (they were acked). Compaction always fsyncs its new file before the rename.

Record layout: u32 payload length, u32 checksum of the payload, u8 record type, payload. The
checksum is the low 32 bits of XXH3-64 when the type byte has `_XXH3` set (every record written
now), else zlib's crc32 (files written before): crc32 cost ~17 CPU-us per 49 kB trajectory, a
third of the server's own work per item, where XXH3 costs under 1.
A record cut short at the end of the file (the process died mid-write) was never acknowledged:
it is cut off with a warning. A bad checksum before the end means the file is damaged: that is an
error naming the file and the offset, never a silent skip.
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IIB")
_IOV_MAX = 1024  # buffers per writev (Linux's limit)
_XXH3 = 0x80
"""Flag in the record type byte: the checksum is XXH3-64's low 32 bits (else crc32)."""
_LOW32 = 0xFFFFFFFF
WAL_FILE = "buffer.wal"


class RecordType(enum.IntEnum):
    TRAJECTORY = 1
    """A received trajectory: its wire frame, exactly as it arrived."""
    RELEASE = 2
    """An incomplete group released by the group timeout (a decision replay must not re-make)."""
    DELIVER = 3
    """A batch handed to the trainer: batch id, version, group ids."""
    VERSION = 4
    """The trainer's version, the batches it reported trained, whether it restarted."""
    SNAPSHOT = 5
    """Everything live at compaction time, as one msgpack document (older files; no longer written)."""
    EVICT = 7
    """Ready groups dropped when a batch was asked for (tokens ahead of every version reached):
    a decision of that moment, which replay must not re-make. Group ids and the reason."""
    SNAPSHOT_FRAMES = 6
    """Everything live at compaction time, trajectories as their wire frames (`buffer.snapshot`);
    always the first record of a compacted file."""


class WALCorruptError(RuntimeError):
    """The log is damaged before its end; the message names the file, the offset and the fix."""


class WriteAheadLog:
    """Append records; `commit` makes them survive the process (and, with fsync, the machine)."""

    def __init__(self, directory: str | Path, fsync: bool = False) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / WAL_FILE
        self.fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: list[bytes | memoryview] = []
        """Headers and payloads appended since the last commit, written by one writev per commit."""
        self._pending_bytes = 0

    @property
    def size_bytes(self) -> int:
        """Bytes in the file plus those appended and not yet committed."""
        return os.fstat(self._fd).st_size + self._pending_bytes

    def replay(self) -> Iterator[tuple[RecordType, bytes]]:
        """Yield every record in the file, cutting off a torn last record."""
        data = self.path.read_bytes()
        offset = 0
        while offset < len(data):
            if offset + _HEADER.size > len(data):
                self._cut_tail(offset, len(data))
                return
            length, crc, rtype = _HEADER.unpack_from(data, offset)
            end = offset + _HEADER.size + length
            if end > len(data):
                self._cut_tail(offset, len(data))
                return
            payload = data[offset + _HEADER.size : end]
            if _checksum(payload, rtype) != crc or rtype & ~_XXH3 not in RecordType._value2member_map_:
                raise WALCorruptError(
                    f"{self.path}: damaged record at byte {offset} (checksum or type mismatch); "
                    "move the file aside to start an empty buffer, or restore it from a backup"
                )
            yield RecordType(rtype & ~_XXH3), payload
            offset = end

    def _cut_tail(self, offset: int, size: int) -> None:
        log.warning(
            "%s: the last %d bytes are a record cut short by a crash (never acknowledged); removing them",
            self.path, size - offset,
        )
        os.truncate(self.path, offset)

    def append(self, rtype: RecordType, payload: bytes | memoryview) -> None:
        """Queue a record; it is written at the next `commit` (the payload must stay unchanged until then)."""
        checksum = xxhash.xxh3_64_intdigest(payload) & _LOW32
        self._pending.append(_HEADER.pack(len(payload), checksum, rtype | _XXH3))
        self._pending.append(payload)
        self._pending_bytes += _HEADER.size + len(payload)

    def commit(self) -> None:
        """Hand appended records to the OS (they survive a kill -9), and fsync if configured."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._pending_bytes = 0
        for start in range(0, len(pending), _IOV_MAX):
            chunk = pending[start : start + _IOV_MAX]
            want = sum(len(b) for b in chunk)
            done = os.writev(self._fd, chunk)
            if done != want:  # a short write (disk full, signal): finish it buffer by buffer
                _write_rest(self._fd, chunk, done)
        if self.fsync:
            os.fsync(self._fd)

    def rewrite(self, records: Iterable[tuple[RecordType, Sequence[bytes | memoryview]]]) -> None:
        """Replace the whole log by `records` atomically (compaction). Each payload is given as the
        buffers that make it up, written one after another (no concatenation into one copy)."""
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for rtype, parts in records:
                h = xxhash.xxh3_64()
                for part in parts:
                    h.update(part)
                bufs = [_HEADER.pack(sum(len(b) for b in parts), h.intdigest() & _LOW32, rtype | _XXH3), *parts]
                for start in range(0, len(bufs), _IOV_MAX):
                    chunk = bufs[start : start + _IOV_MAX]
                    done = os.writev(fd, chunk)
                    if done != sum(len(b) for b in chunk):
                        _write_rest(fd, chunk, done)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._pending = []
        self._pending_bytes = 0
        os.close(self._fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself must survive a crash
        finally:
            os.close(dir_fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        self.commit()
        os.close(self._fd)


def _checksum(payload: bytes | memoryview, rtype: int) -> int:
    """The checksum a record of type byte `rtype` carries (see the module docstring)."""
    if rtype & _XXH3:
        return xxhash.xxh3_64_intdigest(payload) & _LOW32
    return zlib.crc32(payload)


def _write_rest(fd: int, chunk: list[bytes | memoryview], done: int) -> None:
    for buf in chunk:
        view = memoryview(buf)
        if done >= len(view):
            done -= len(view)
            continue
        view = view[done:]
        done = 0
        while view:
            view = view[os.write(fd, view) :]
