"""SGLang 0.5.23's own source, read from its wheel with `ast`, for the conformance tests.

SGLang does not import here (its kernels need a GPU stack), but its request classes and routes
parse. The wheel is fetched once per machine with `pip download --no-deps` (PyPI only).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

SGLANG_VERSION = "0.5.23"
FILES = {
    "http": "sglang/srt/entrypoints/http_server.py",
    "io": "sglang/srt/managers/io_struct.py",
    "sampling": "sglang/srt/sampling/sampling_params.py",
    "versions": "sglang/srt/utils/weight_versions.py",
    "api": "sglang/api/v1/api_types.py",
    "v1_loads": "sglang/srt/entrypoints/v1_loads.py",
    "loads": "sglang/srt/managers/load_snapshot.py",
}


def sglang_wheel() -> Path:
    cache = Path.home() / ".cache" / "slime_async" / f"sglang-{SGLANG_VERSION}"
    wheels = sorted(cache.glob("sglang-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={SGLANG_VERSION}", "-d", str(cache)],
            capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, f"could not download the sglang wheel: {done.stderr[-2000:]}"
        wheels = sorted(cache.glob("sglang-*.whl"))
    return wheels[0]


def load_source() -> dict[str, ast.Module]:
    with zipfile.ZipFile(sglang_wheel()) as wheel:
        return {key: ast.parse(wheel.read(path)) for key, path in FILES.items()}


def load_api(directory: Path) -> ModuleType:
    """SGLang's generated JSON contract (`sglang.api.v1.api_types`): it needs only msgspec, so it imports."""
    path = directory / "sglang_api_types.py"
    with zipfile.ZipFile(sglang_wheel()) as wheel:
        path.write_bytes(wheel.read(FILES["api"]))
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def class_defaults(tree: ast.Module, name: str) -> dict[str, ast.expr | None]:
    """A class's fields with their default expressions (None: required), its bases' in this file too
    (SGLang's `BaseReq` gives every control body `rid` and `http_worker_ipc`)."""
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    if name not in classes:
        raise AssertionError(f"SGLang has no class {name}")
    node = classes[name]
    out: dict[str, ast.expr | None] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out |= class_defaults(tree, base.id)
    for s in node.body:
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            out[s.target.id] = s.value
    return out


def class_fields(tree: ast.Module, name: str) -> set[str]:
    return set(class_defaults(tree, name))


def routes(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr in (
                    "get", "post", "api_route", "put"
                ) and dec.args and isinstance(dec.args[0], ast.Constant):
                    out.add(dec.args[0].value)
    return out
