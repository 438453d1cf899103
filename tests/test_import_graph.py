"""normkit's modules import one another without a cycle, read statically from their source.

Every ``import`` counts, also one inside a function (a lazy import is still a dependency). An
import of ``normkit.a.b`` is an edge to ``normkit.a.b``; ``from normkit.a import x`` is an edge
to ``normkit.a.x`` when that is a module, else to ``normkit.a``. So do the imports the code makes
by name: ``importlib.import_module("normkit.a")`` (an f-string name is an edge to every module it
can spell) and code in a string that a subprocess runs (``"from normkit import a"``).
"""

import ast
import re
from pathlib import Path

import normkit

ROOT = Path(normkit.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _named_module(call: ast.Call, known: dict[str, Path]) -> set[str]:
    """The modules an ``import_module(name)`` call can import: a constant name, or every known
    module an f-string name can spell."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if called != "import_module" or not call.args:
        return set()
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return {arg.value}
    if isinstance(arg, ast.JoinedStr):
        pattern = "".join(
            re.escape(part.value) if isinstance(part, ast.Constant) else r"[\w.]+"
            for part in arg.values
        )
        return {m for m in known if re.fullmatch(pattern, m)}
    return set()


def _code_in(text: str) -> ast.Module | None:
    """``text`` parsed as Python when it is code that imports something, else None."""
    if "import " not in text:
        return None
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def imports(name: str, path: Path, known: dict[str, Path], tree: ast.AST | None = None) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree or ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            found |= _named_module(node, known)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            code = _code_in(node.value)
            if code is not None:
                found |= imports(name, path, known, code)
        elif isinstance(node, ast.Import):
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


def test_imports_by_name_and_in_code_strings_are_edges():
    known = modules()
    assert "normkit.bridges" in imports("normkit.backends", known["normkit.backends"], known)
    assert "normkit.backends" not in imports("normkit.bridges", known["normkit.bridges"], known)
    worker = imports("normkit.bench.worker", known["normkit.bench.worker"], known)
    assert {"normkit.bench.torch", "normkit.bench.tf", "normkit.bench.jax"} <= worker
    code = ast.parse('subprocess.run(["python", "-c", "from normkit import backends"])')
    assert imports("normkit.x", ROOT / "x.py", known, code) == {"normkit.backends"}
    named = ast.parse('importlib.import_module("normkit.port.plan")')
    assert imports("normkit.x", ROOT / "x.py", known, named) == {"normkit.port.plan"}


def test_no_import_cycle_in_normkit():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 40 and "normkit.port.plan" in graph["normkit.port.torch"]
    assert cycle(graph) == []


def test_adapters_do_not_import_the_tools_built_on_them():
    """No module of normkit.torch, normkit.tf or normkit.jax imports the harness or the tools:
    their conformance hooks and benchmarks live under normkit.conformance and normkit.bench."""
    known = modules()
    adapters = [name for name in known if name.split(".")[1:2] in (["torch"], ["tf"], ["jax"])]
    assert "normkit.torch.functional" in adapters and "normkit.jax.nnx" in adapters
    for name in adapters:
        upward = {m for m in imports(name, known[name], known)
                  if m.split(".")[1] in ("port", "conformance", "bench", "identify", "cli")}
        assert not upward, (name, upward)
