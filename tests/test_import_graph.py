"""normkit's modules import one another without a cycle, read statically from their source.

Every ``import`` counts, also one inside a function (a lazy import is still a dependency). An
import of ``normkit.a.b`` is an edge to ``normkit.a.b``; ``from normkit.a import x`` is an edge
to ``normkit.a.x`` when that is a module, else to ``normkit.a``.
"""

import ast
from pathlib import Path

import normkit

ROOT = Path(normkit.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (a list of modules, the first repeated last), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_detector_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_normkit():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 40 and "normkit.port.plan" in graph["normkit.port.torch"]
    assert cycle(graph) == []


def test_adapters_do_not_import_the_tools_built_on_them():
    known = modules()
    for name, path in known.items():
        if name.split(".")[1:2] in (["torch"], ["tf"], ["jax"]) and not name.endswith(
            (".conformance", ".bench")
        ):
            upward = {m for m in imports(name, path, known)
                      if m.split(".")[1] in ("port", "conformance", "bench", "identify", "cli")}
            assert not upward, (name, upward)
