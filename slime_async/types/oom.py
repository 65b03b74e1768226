"""Running out of memory: how a part recognises it, and the exit code that tells the launcher.

A part that ran out of memory (a CUDA allocation, or the host's) would do so again when restarted
with the same settings: the launcher stops the run at once on this exit code, with the part's own
message, which names the settings that decide the part's memory. Restarting would only repeat the
failure `launch.max_restarts` times and hide the message in the restarts' noise.
"""

from __future__ import annotations

OUT_OF_MEMORY_EXIT = 75
"""Exit code of a part that ran out of memory (EX_TEMPFAIL's number; nothing else here uses it)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's `OutOfMemoryError` (CUDA), or an allocator's RuntimeError for the host's memory."""
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
        return True
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        words in text for words in ("out of memory", "not enough memory", "can't allocate memory"))
