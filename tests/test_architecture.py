"""The import graph of `slime_async` has no cycles between files, none between parts except those
docs/architecture.md names with a reason, and every part imports only parts below it in that page's
layers ("Import rules").

Edges, read with `ast` (nothing is imported): every `import X` and `from X import Y` in a file,
wherever it stands: at module level, inside a function, or under `if TYPE_CHECKING:` (a lazy or
type-only import still ties the two files together). `from P import Y` is an edge to the module
`P.Y` when that is a file, else to `P` (its `__init__.py`). The implicit import of a module's parent
packages is not counted (every submodule would otherwise form a cycle with its package's
`__init__.py`, which is how packages work, not a knot). A part is a sub-package of `slime_async`
(`slime_async.rollout.client` belongs to `rollout`).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

Graph = dict[str, set[str]]


def modules(package_dir: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's `__init__.py`)."""
    out = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(package_dir: Path) -> Graph:
    """Module -> the package's modules it imports (see the module docstring for what counts)."""
    mods = modules(package_dir)
    top = package_dir.name

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: Graph = {m: set() for m in mods}
    for name, (path, is_package) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names if a.name.split(".")[0] == top]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the file's own package, up level - 1
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != top:
                    continue
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else known(source)
                           for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def part_graph(graph: Graph) -> Graph:
    def part(module: str) -> str:
        pieces = module.split(".")
        return pieces[1] if len(pieces) > 1 else pieces[0]

    parts: Graph = defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            if part(a) != part(b):
                parts[part(a)].add(part(b))
    return dict(parts)


def named_part_cycles(doc: str) -> dict[frozenset[str], str]:
    """The part cycles docs/architecture.md allows: lines `- {a, b}: reason` under "Import rules"."""
    section = doc.split("### Import rules", 1)[1].split("\n## ", 1)[0]
    out = {}
    for match in re.finditer(r"^- `\{([a-z_, ]+)\}`: (.+)$", section, re.MULTILINE):
        out[frozenset(p.strip() for p in match.group(1).split(","))] = match.group(2).strip()
    return out


def layers(doc: str) -> dict[str, int]:
    """Each part's rank in docs/architecture.md's numbered layers ("From the bottom up"): a line's
    parts, and within a line the groups split by "then", rank upwards."""
    section = doc.split("From the bottom up", 1)[1].split("\n\n", 2)[1]
    ranks: dict[str, int] = {}
    for line in re.findall(r"^\d+\. (.+)$", section, re.MULTILINE):
        for group in line.split(" then "):
            rank = len(set(ranks.values()))
            ranks.update({name: rank for name in re.findall(r"`([a-z_]+)`", group)})
    return ranks


def test_no_file_imports_another_that_imports_it_back() -> None:
    found = cycles(import_graph(ROOT / "slime_async"))
    assert found == [], f"import cycles between files: {found}"


def test_parts_form_no_cycles_but_those_the_architecture_doc_names() -> None:
    allowed = named_part_cycles(DOC.read_text())
    found = [frozenset(c) for c in cycles(part_graph(import_graph(ROOT / "slime_async")))]
    unnamed = [sorted(c) for c in found if c not in allowed]
    assert unnamed == [], f"import cycles between parts that docs/architecture.md does not name: {unnamed}"
    stale = [sorted(c) for c in allowed if c not in found]
    assert stale == [], f"docs/architecture.md names part cycles that no longer exist: {stale}"


def test_the_checker_sees_cycles_of_every_kind_of_import(tmp_path: Path) -> None:
    """A package with a lazy cycle, a TYPE_CHECKING cycle, a relative-import cycle and a part cycle."""
    pkg = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "def f():\n    from pkg.a import two\n",
        "a/two.py": "from pkg.a.one import f\n",
        "a/three.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b.four import X\n",
        "b/__init__.py": "",
        "b/four.py": "from ..a import three\nX = 1\n",
        "b/five.py": "import pkg.c.six\n",
        "c/__init__.py": "",
        "c/six.py": "import os\nfrom pkg.b import five\n",
        "c/seven.py": "from pkg.a import one\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert cycles(graph) == [["pkg.a.one", "pkg.a.two"], ["pkg.a.three", "pkg.b.four"],
                             ["pkg.b.five", "pkg.c.six"]]
    assert cycles(part_graph(graph)) == [["a", "b", "c"]]
    assert named_part_cycles("### Import rules\n\n- `{a, b}`: why\n- `{c}` no reason\n\n## Next\n- `{x, y}`: z") == {
        frozenset({"a", "b"}): "why"}


def test_every_part_imports_only_parts_below_it_in_the_architecture_doc() -> None:
    rank = layers(DOC.read_text())
    package = ROOT / "slime_async"
    parts = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    assert sorted(rank) == parts, "docs/architecture.md's layers must list every part once"
    upward = sorted((a, b) for a, targets in part_graph(import_graph(package)).items() for b in targets
                    if rank[b] >= rank[a])
    assert upward == [], f"imports that go up or sideways in docs/architecture.md's layers: {upward}"


def test_layers_are_read_bottom_up_and_then_splits_a_line() -> None:
    doc = "From the bottom up, each part:\n\n1. `a`, `b`;\n2. `c`, then `d` and `e`.\n\nAfter."
    assert layers(doc) == {"a": 0, "b": 0, "c": 1, "d": 2, "e": 2}
