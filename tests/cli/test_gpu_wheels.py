"""scripts/gpu_wheels.py: wheels split into parts that fit a device call, trimmed, joined and installed
again (here with pip into a temporary folder, as on the GPU machine)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_wheels.py"


@pytest.fixture(scope="module")
def gw() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_wheels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel of package `name` holding `files` (paths inside it)."""
    dist = f"{name}-1.0.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
            f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    members = {**files, **meta}
    record = "\n".join([*(_record_line(n, d) for n, d in members.items()), f"{dist}/RECORD,,"]) + "\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, d in {**members, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(n, d)
    return path


def test_parts_fit_the_limit_and_join_back_into_installable_wheels(gw: ModuleType, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    rng = random.Random(0)
    wheels = tmp_path / "wheels" / "set"
    wheels.mkdir(parents=True)
    big = make_wheel(wheels, "bigpkg", {"bigpkg/__init__.py": b"X = 1\n",
                                        "bigpkg/blob.bin": rng.randbytes(3 * 2**20)})  # over the limit: split
    small = [make_wheel(wheels, f"small{i}", {f"small{i}/__init__.py": f"N = {i}\n".encode()}) for i in range(5)]
    originals = {w.name: w.read_bytes() for w in [big, *small]}
    monkeypatch.setattr(gw, "WHEELS", tmp_path / "wheels")
    parts = gw.split(["set"], tmp_path / "out", limit_mib=1.0)
    assert len(parts) >= 4  # 3 MiB of blob in pieces of at most 1 MiB, and the small wheels
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= 2**20
    assert any(f.name.endswith(".part00") for p in parts for f in p.iterdir())

    carry = tmp_path / "carry"
    for part in parts:  # one device call each: stash, then the last one installs
        gw.stash(part, carry)
    site = tmp_path / "site"
    gw.install(site, carry)
    assert {w.name: w.read_bytes() for w in carry.glob("*.whl")} == originals  # joined byte for byte
    assert not list(carry.glob("*.part*"))
    out = subprocess.run([sys.executable, "-c", "import bigpkg, small4; print(bigpkg.X, small4.N)"],
                         env={"PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "4"]


def test_a_trimmed_wheel_installs_without_the_dropped_files(gw: ModuleType, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "kern", {"kern/__init__.py": b"OK = True\n", "kern/flash.so": b"\0" * 4096,
                                          "kern/sm100/ops.so": b"\0" * 2048, "kern/common.so": b"keep"})
    saved = gw.trim_wheel(wheel, ("kern/flash.so", "kern/sm100/"))
    assert saved > 0
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("kern-1.0.dist-info/RECORD").decode()
    assert "kern/flash.so" not in names and "kern/sm100/ops.so" not in names and "kern/common.so" in names
    assert "flash.so" not in record and "kern/common.so" in record
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    str(wheel)], check=True)  # as on the GPU machine
    assert (site / "kern" / "common.so").read_bytes() == b"keep" and not (site / "kern" / "flash.so").exists()
