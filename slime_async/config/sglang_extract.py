"""Extract SGLang's `ServerArgs` fields and their command-line flags from SGLang's own source.

`python -m slime_async.config.sglang_extract [--wheel WHEEL] [--out FILE]` reads
`sglang/srt/server_args.py` and the field namespaces it assembles `ServerArgs` from
(`sglang/srt/arg_groups/fields/*.py`) with `ast` (SGLang does not import without its GPU stack),
and writes `sglang_server_args.json` beside this file: one entry per field with the flag that
`python -m sglang.launch_server` takes for it, its aliases, its kind (how a YAML value becomes
arguments) and its choices. Without `--wheel` it downloads `sglang==SGLANG_VERSION` with
`pip download --no-deps` into `~/.cache/slime_async/sglang-VERSION` (the cache the engine
conformance tests use). Run it again when the pinned SGLang version changes; the tests compare the
checked-in file with a fresh extraction whenever the wheel is at hand.

The rules mirror SGLang's `arg_utils.add_cli_args_from_dataclass`: a field annotated
`A[T, "help"]` or `A[T, Arg(...)]` gets `Arg.cli_name` or `--field-name` plus `Arg.aliases`;
`bool` is a store-true switch, `argparse.BooleanOptionalAction` a `--x/--no-x` pair, `List[T]`
takes several values unless a `type_parser` reads one string; `Arg(no_cli=True)` has no flag
unless `ServerArgs.add_cli_args` registers one by hand (those registrations are read too).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from slime_async.config.sglang import SPEC_PATH

SGLANG_VERSION = "0.5.23"
SERVER_ARGS = "sglang/srt/server_args.py"
FIELDS_DIR = "sglang/srt/arg_groups/fields/"
CHOICES = "sglang/srt/arg_groups/choices.py"


def cached_wheel(version: str = SGLANG_VERSION, download: bool = True) -> Path | None:
    """SGLang's wheel in the shared cache, downloaded (PyPI, `--no-deps`) when missing and allowed."""
    cache = Path.home() / ".cache" / "slime_async" / f"sglang-{version}"
    wheels = sorted(cache.glob("sglang-*.whl"))
    if wheels or not download:
        return wheels[0] if wheels else None
    cache.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={version}",
                           "-d", str(cache)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"could not download the sglang {version} wheel: {done.stderr[-2000:]}")
    return sorted(cache.glob("sglang-*.whl"))[0]


def read_sources(wheel: Path) -> dict[str, str]:
    """The source files the extraction needs, by their path inside the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n in (SERVER_ARGS, CHOICES) or (n.startswith(FIELDS_DIR)
                                                                              and n.endswith(".py"))]
        return {n: zf.read(n).decode() for n in names}


def extract(sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    """field name -> {flag, aliases, kind, optional, choices, default, type_parser}, in SGLang's order."""
    server_args = ast.parse(sources[SERVER_ARGS])
    namespaces = _input_namespaces(server_args)
    classes = {}
    for path, text in sources.items():
        if path.startswith(FIELDS_DIR):
            for node in ast.parse(text).body:
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = node
    missing = [n for n in namespaces if n not in classes]
    if missing:
        raise ValueError(f"ServerArgs namespaces not found under {FIELDS_DIR}: {missing}")
    named_choices = _named_choices(ast.parse(sources[CHOICES]))
    fields: dict[str, dict[str, Any]] = {}
    for name in namespaces:
        for stmt in classes[name].body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields[stmt.target.id] = _field(stmt, named_choices)
    for dest, entry in _manual_flags(server_args).items():
        if dest in fields and fields[dest]["flag"] is None:
            fields[dest].update(entry)
    return json.loads(json.dumps(fields))  # as the checked-in file holds it (tuples become lists)


def _input_namespaces(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                 for t in node.targets) and isinstance(node.value, ast.List)):
            return [e.id for e in node.value.elts if isinstance(e, ast.Name)]
    raise ValueError(f"{SERVER_ARGS}: no _INPUT_NAMESPACES list (has SGLang changed how ServerArgs is built?)")


def _field(stmt: ast.AnnAssign, named_choices: dict[str, list[Any]]) -> dict[str, Any]:
    name = stmt.target.id  # type: ignore[union-attr]
    inner, arg = _unwrap_annotated(stmt.annotation)
    meta = _arg_meta(arg)
    open_choices = isinstance(meta.get("choices"), ast.expr)
    if open_choices:
        # built from a shared list that plugins may extend (add_*_choices): known values, not a closed set
        meta["choices"] = _choices(meta["choices"], named_choices)
    default = _literal(stmt.value) if stmt.value is not None else None
    inner, optional = _unwrap_optional(inner)
    entry: dict[str, Any] = {"flag": None, "aliases": [], "kind": "str", "optional": optional,
                             "choices": meta.get("choices"), "default": default,
                             "type_parser": meta.get("type_parser")}
    if open_choices:
        entry["open_choices"] = True
    if meta.get("no_cli") or name.startswith("_"):
        return entry  # no command-line surface (unless registered by hand, see _manual_flags)
    entry["flag"] = meta.get("cli_name") or "--" + name.replace("_", "-")
    entry["aliases"] = meta.get("aliases") or []
    action = meta.get("action")
    literal = _literal_choices(inner)
    if action is not None:
        entry["kind"] = "bool_optional" if action == "BooleanOptionalAction" else f"action:{action}"
    elif literal is not None:
        entry["kind"] = "int" if literal and all(isinstance(v, int) for v in literal) else "str"
        entry["choices"] = entry["choices"] or literal
    elif meta.get("nargs") in ("*", "+"):  # several values whatever the annotation says
        entry["kind"], entry["item"] = "list", "str"
    elif _is_list(inner) and meta.get("type_parser") is None:
        entry["kind"] = "list"
        entry["item"] = {"int": "int", "float": "float"}.get(_name(_list_item(inner)) or "", "str")
    elif meta.get("type_parser") is not None:
        entry["kind"] = "json" if meta["type_parser"] in ("json.loads", "json_list_type") else "str"
    else:
        entry["kind"] = {"bool": "bool", "int": "int", "float": "float"}.get(_name(inner) or "", "str")
    return entry


def _named_choices(tree: ast.Module) -> dict[str, list[Any]]:
    """Module-level literal lists of `arg_groups/choices.py` (LOAD_FORMAT_CHOICES = [...])."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = _literal(node.value)
            if isinstance(value, list):
                out[node.targets[0].id] = value
    return out


def _choices(node: ast.expr, named: dict[str, list[Any]]) -> list[Any] | None:
    """`NAME`, `NAME + [...]` or `[...] + NAME` over the lists of choices.py; None when not that simple."""
    if isinstance(node, ast.Name):
        return named.get(node.id)
    if isinstance(node, ast.List | ast.Tuple):
        value = _literal(node)
        return list(value) if isinstance(value, list | tuple) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _choices(node.left, named), _choices(node.right, named)
        return left + right if left is not None and right is not None else None
    return None


def _manual_flags(tree: ast.Module) -> dict[str, dict[str, Any]]:
    """`parser.add_argument("--x", ...)` calls in ServerArgs.add_cli_args: dest -> flag entry."""
    out: dict[str, dict[str, Any]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument" and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        flag = node.args[0].value
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        action = kw.get("action")
        action_name = _name(action) if action is not None else None
        if action_name and action_name.startswith("Deprecated"):
            continue
        dest = _literal(kw["dest"]) if "dest" in kw else flag.lstrip("-").replace("-", "_")
        if isinstance(action, ast.Constant) and action.value == "store_true":
            kind = "bool"
        else:
            kind = {"int": "int", "float": "float"}.get(_name(kw.get("type")) or "", "str")
        out[dest] = {"flag": flag, "kind": kind, "manual": True}
    return out


def _unwrap_annotated(node: ast.expr) -> tuple[ast.expr, ast.expr | None]:
    if isinstance(node, ast.Subscript) and _name(node.value) in ("A", "Annotated") and isinstance(node.slice,
                                                                                                 ast.Tuple):
        inner, *rest = node.slice.elts
        return inner, (rest[0] if rest else None)
    return node, None


def _arg_meta(node: ast.expr | None) -> dict[str, Any]:
    if isinstance(node, ast.Constant):  # a bare help string
        return {}
    if not (isinstance(node, ast.Call) and _name(node.func) == "Arg"):
        return {"no_cli": True}  # no Arg metadata: add_cli_args_from_dataclass skips the field
    meta: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg in ("cli_name", "aliases", "no_cli", "nargs"):
            meta[kw.arg] = _literal(kw.value)
        elif kw.arg == "choices":
            value = _literal(kw.value)
            meta[kw.arg] = value if not isinstance(value, str) or isinstance(kw.value, ast.Constant) else kw.value
        elif kw.arg in ("action", "type_parser"):
            meta[kw.arg] = ast.unparse(kw.value).rsplit(".", 1)[-1] if kw.arg == "action" else ast.unparse(kw.value)
    return meta


def _unwrap_optional(node: ast.expr) -> tuple[ast.expr, bool]:
    if isinstance(node, ast.Subscript) and _name(node.value) == "Optional":
        return node.slice, True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        for a, b in ((node.left, node.right), (node.right, node.left)):
            if isinstance(b, ast.Constant) and b.value is None:
                return a, True
    if isinstance(node, ast.Subscript) and _name(node.value) == "Union" and isinstance(node.slice, ast.Tuple):
        rest = [e for e in node.slice.elts if not (isinstance(e, ast.Constant) and e.value is None)]
        if len(rest) == 1 and len(node.slice.elts) == 2:
            return rest[0], True
    return node, False


def _literal_choices(node: ast.expr) -> list[Any] | None:
    if isinstance(node, ast.Subscript) and _name(node.value) == "Literal":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return [_literal(e) for e in elts]
    return None


def _is_list(node: ast.expr) -> bool:
    return isinstance(node, ast.Subscript) and _name(node.value) in ("List", "list")


def _list_item(node: ast.Subscript) -> ast.expr | None:
    return node.slice if not isinstance(node.slice, ast.Tuple) else None


def _name(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _literal(node: ast.expr) -> Any:
    """The value of a literal expression; anything computed becomes its source text."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slime_async.config.sglang_extract", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--wheel", type=Path, help=f"an sglang wheel (default: sglang=={SGLANG_VERSION}, cached)")
    parser.add_argument("--out", type=Path, default=SPEC_PATH)
    args = parser.parse_args(argv)
    wheel = args.wheel or cached_wheel()
    assert wheel is not None
    fields = extract(read_sources(wheel))
    spec = {"sglang_version": SGLANG_VERSION if args.wheel is None else wheel.name.split("-")[1],
            "generated_by": "python -m slime_async.config.sglang_extract", "fields": fields}
    args.out.write_text(json.dumps(spec, indent=1, sort_keys=False) + "\n")
    with_flags = sum(1 for f in fields.values() if f["flag"])
    print(f"wrote {args.out}: {len(fields)} ServerArgs fields, {with_flags} with a command-line flag")


if __name__ == "__main__":
    main()
