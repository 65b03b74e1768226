#!/usr/bin/env python3
"""Bring real SGLang / vLLM (and our own runtime needs) to the GPU machine as wheels.

The GPU machine has no network: Python 3.12, torch 2.11.0+cu130 preinstalled, nothing else that an
inference server needs. The device tool carries at most 64 MiB a call (the working tree included) and
keeps ignored files between calls while the machine stays warm (30 s idle). So, on a machine with
the package index:

    python3 scripts/gpu_wheels.py resolve sglang           # newest release pinning the GPU's torch
    python3 scripts/gpu_wheels.py download sglang ours     # the pinned lists in scripts/gpu_wheels/
    python3 scripts/gpu_wheels.py trim                     # drop kernels we do not load (FA2/FA3 builds)
    python3 scripts/gpu_wheels.py split sglang ours        # .whl_1, .whl_2, ... each under --limit MiB

and on the GPU machine, one device call per part (each carrying `.whl_K`, within the warm window):

    python3 scripts/gpu_wheels.py stash .whl_K             # copy the part to /tmp/carry
    python3 scripts/gpu_wheels.py install --site /tmp/site # last call: join split wheels, pip install

The lists in scripts/gpu_wheels/*.txt are what each server's start-up imports and the GPU image lacks
(found by a static import walk, then by starting the server there); `resolve` says when a newer
release fits the GPU's torch, so the lists can be redone for it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "gpu_wheels"
WHEELS = Path(os.environ.get("GPU_WHEELS_DIR", "/tmp/gpu_wheels"))
"""Where downloads land (outside the repo: hundreds of MB)."""
GPU_TORCH = "2.11.0"
PLATFORMS = ["manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
"""pip matches each manylinux tag exactly: the GPU image's glibc is 2.39, so every tag up to it."""
TRIM = {
    "sglang_kernel": ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/"),
    # FA3 (342 MB): SGLang then starts with --attention-backend triton; sm100: Blackwell only.
    "vllm": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",),
    # FA2: Hopper runs vLLM's FA3 build.
}


class _RemoteFile(io.RawIOBase):
    """A wheel on the index read by HTTP range requests: `zipfile` reads its directory and METADATA
    (a few KiB) instead of downloading hundreds of MB per release to learn one pin."""

    def __init__(self, url: str) -> None:
        self.url, self.pos = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as resp:
            self.size = int(resp.headers["Content-Length"])

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        if self.pos >= self.size:
            return 0
        end = min(self.pos + len(buffer), self.size) - 1
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end}"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            data = resp.read()
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def requires(package: str, version: str, files: list[dict]) -> list[str]:
    """`Requires-Dist` of `package==version`'s x86-64 wheel, read from its METADATA remotely."""
    wheel = next((f for f in files if f["filename"].startswith(f"{package.replace('-', '_')}-{version}-")
                  and f["filename"].endswith(".whl") and "aarch64" not in f["filename"]), None)
    if wheel is None:
        return []
    with zipfile.ZipFile(io.BufferedReader(_RemoteFile(wheel["url"]), buffer_size=1 << 16)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines()
                if ln.startswith("Requires-Dist:")]


def resolve(package: str, torch_version: str = GPU_TORCH) -> str:
    """The newest release of `package` whose metadata pins torch==`torch_version` (the index's simple
    JSON API, then each candidate wheel's METADATA by range requests)."""
    request = urllib.request.Request(f"https://pypi.org/simple/{package}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        index = json.load(resp)
    pattern = re.compile(rf"^torch\s*==\s*{re.escape(torch_version)}(\s|;|$)")

    def key(v: str) -> tuple:
        return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[.+]", v))

    for version in sorted((v for v in index["versions"] if re.fullmatch(r"[\d.]+", v)), key=key, reverse=True):
        torch_pins = [r for r in requires(package, version, index["files"])
                      if re.match(r"torch\b", r) and "extra" not in r]
        print(f"{package} {version}: {', '.join(torch_pins) or 'no torch pin'}")
        if any(pattern.match(r) for r in torch_pins):
            return version
    raise SystemExit(f"no {package} release pins torch=={torch_version}")


def pins(name: str) -> list[str]:
    lines = (HERE / f"{name}.txt").read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def download(names: list[str]) -> None:
    for name in names:
        dest = WHEELS / name
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd + pins(name), check=True)
        print(f"{name}: {_mib(dest.glob('*.whl')):.1f} MiB in {len(list(dest.glob('*.whl')))} wheels")


def trim_wheel(path: Path, drop: tuple[str, ...]) -> int:
    """Rewrite `path` without the members starting with `drop` (RECORD fixed so pip installs it);
    returns the bytes saved."""
    before = path.stat().st_size
    tmp = path.with_suffix(".trimming")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if item.filename.startswith(drop):
                continue
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(ln for ln in data.splitlines(True) if not ln.decode().startswith(drop))
            zout.writestr(item, data)
    tmp.replace(path)
    return before - path.stat().st_size


def trim() -> None:
    for wheel in WHEELS.glob("*/*.whl"):
        drop = TRIM.get(wheel.name.split("-")[0])
        if drop:
            saved = trim_wheel(wheel, drop)
            print(f"{wheel.name}: -{saved / 2**20:.0f} MiB -> {wheel.stat().st_size / 2**20:.1f} MiB")


def split(names: list[str], out: Path, limit_mib: float) -> list[Path]:
    """Pack the wheels of `names` into `out/.whl_1`, `.whl_2`, ... of at most `limit_mib` each; a wheel
    larger than that travels as `NAME.whl.partNN` pieces (first-fit decreasing)."""
    limit = int(limit_mib * 2**20)
    pieces: list[tuple[int, Path, int, str]] = []
    wheels = {w.name: w for n in names for w in sorted((WHEELS / n).glob("*.whl"))}  # one copy of a shared pin
    for wheel in wheels.values():
        size = wheel.stat().st_size
        if size <= limit:
            pieces.append((size, wheel, 0, wheel.name))
        else:
            pieces += [(min(limit, size - off), wheel, off, f"{wheel.name}.part{i:02d}")
                       for i, off in enumerate(range(0, size, limit))]
    bins: list[list] = []
    for piece in sorted(pieces, key=lambda p: -p[0]):
        for b in bins:
            if b[0] + piece[0] <= limit:
                b[0] += piece[0]
                b[1].append(piece)
                break
        else:
            bins.append([piece[0], [piece]])
    dirs = []
    for i, (total, members) in enumerate(bins, 1):
        d = out / f".whl_{i}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for size, src, off, name in members:
            with open(src, "rb") as fi, open(d / name, "wb") as fo:
                fi.seek(off)
                fo.write(fi.read(size))
        print(f"{d}: {total / 2**20:.1f} MiB, {len(members)} files")
        dirs.append(d)
    return dirs


def stash(part: Path, carry: Path = Path("/tmp/carry")) -> None:
    carry.mkdir(parents=True, exist_ok=True)
    for f in part.iterdir():
        shutil.copy2(f, carry / f.name)
    print(f"{part} -> {carry}: {_mib(carry.iterdir()):.1f} MiB there")


def install(site: Path, carry: Path = Path("/tmp/carry")) -> None:
    """Join split wheels, then install everything in `carry` into `site` (no index, no dependency
    resolution: the lists are the resolution)."""
    for first in carry.glob("*.part00"):
        base = first.name[: -len(".part00")]
        parts = sorted(carry.glob(f"{base}.part*"))
        with open(carry / base, "wb") as fo:
            for p in parts:
                fo.write(p.read_bytes())
                p.unlink()
    wheels = sorted(str(w) for w in carry.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
    print(f"installed {len(wheels)} wheels into {site}")


def _mib(files) -> float:
    return sum(f.stat().st_size for f in files) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("resolve")
    r.add_argument("package")
    r.add_argument("--torch", default=GPU_TORCH)
    d = sub.add_parser("download")
    d.add_argument("lists", nargs="+")
    sub.add_parser("trim")
    s = sub.add_parser("split")
    s.add_argument("lists", nargs="+")
    s.add_argument("--out", type=Path, default=Path("."))
    s.add_argument("--limit", type=float, default=56.0, help="MiB a part (the call's cap is 64 with the tree)")
    st = sub.add_parser("stash")
    st.add_argument("part", type=Path)
    i = sub.add_parser("install")
    i.add_argument("--site", type=Path, default=Path("/tmp/site"))
    a = ap.parse_args()
    if a.cmd == "resolve":
        print(resolve(a.package, a.torch))
    elif a.cmd == "download":
        download(a.lists)
    elif a.cmd == "trim":
        trim()
    elif a.cmd == "split":
        split(a.lists, a.out, a.limit)
    elif a.cmd == "stash":
        stash(a.part)
    else:
        install(a.site)


if __name__ == "__main__":
    main()
