"""Waiting, bounded, for a server to answer its health check."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable


def wait_healthy(url: str, timeout: float, alive: Callable[[], bool] = lambda: True, path: str = "/health",
                 interval: float = 0.5) -> None:
    """Return once `GET url+path` answers 200; RuntimeError when `alive()` turns false (the server's
    process exited), TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{url} exited before its health check passed ({last})")
        try:
            with urllib.request.urlopen(url + path, timeout=5) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:  # refused while it loads, or reset
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(interval)  # the server is loading: ask again
    raise TimeoutError(f"{url}{path} did not answer 200 within {timeout:.0f} s ({last})")
