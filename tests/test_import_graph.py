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
from normkit import backends

ROOT = Path(normkit.__file__).parent
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


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
    """No module of an adapter (each backend's subpackage in `normkit.backends.BACKENDS`)
    imports the harness or the tools: their conformance hooks and benchmarks live under
    normkit.conformance and normkit.bench."""
    known = modules()
    packages = {backend.module for backend in backends.BACKENDS}
    adapters = [name for name in known if any(_within(name, p) for p in packages)]
    assert "normkit.torch.functional" in adapters and "normkit.jax.nnx" in adapters
    assert any(name.startswith("normkit.tf.") for name in adapters)
    for name in adapters:
        upward = {m for m in imports(name, known[name], known)
                  if m.split(".")[1:2] in (["port"], ["conformance"], ["bench"], ["identify"],
                                           ["doctor"], ["cli"], ["testing"])}
        assert not upward, (name, upward)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layers(text: str) -> list[list[str]]:
    """The layers of docs/architecture.md, bottom first: per ``## Title: `a`, `b``` heading
    the modules and packages it names."""
    return [re.findall(r"`(normkit[\w.]*)`", line)
            for line in text.splitlines() if line.startswith("## ") and "`normkit" in line]


def placed(name: str, found: list[list[str]]) -> int | None:
    """The layer of module ``name``: that of the longest name in the headings that is the
    module or a package holding it; None when no heading places it."""
    best: tuple[int, int] | None = None
    for index, names in enumerate(found):
        for named in names:
            if _within(name, named) and (best is None or len(named) > best[1]):
                best = (index, len(named))
    return None if best is None else best[0]


def test_architecture_places_every_module_in_one_layer():
    """Each module of normkit/ is named by a layer heading of docs/architecture.md, itself or
    through its package (a new top-level module or subpackage fails here until the page
    places it)."""
    found = layers(ARCHITECTURE.read_text())
    assert len(found) == 4, found
    unplaced = sorted(name for name in modules() if placed(name, found) is None)
    assert not unplaced, f"docs/architecture.md places no layer for {unplaced}"


def test_architecture_names_every_module():
    """Every module of normkit/ is named on docs/architecture.md (by its dotted name, or as
    ``.name`` in a list after its package's, e.g. `normkit.identify.forward`, ``.variance``),
    so that the map shows where each job lives."""
    text = ARCHITECTURE.read_text()
    missing = [name for name in modules()
               if f"`{name}`" not in text and f"`.{name.rpartition('.')[2]}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_no_module_imports_a_layer_above_its_own():
    """The layering of docs/architecture.md holds: semantics, adapters, harness, tools, each
    importing only its own layer and those below."""
    found = layers(ARCHITECTURE.read_text())
    known = modules()
    upward = []
    for name, path in known.items():
        own = placed(name, found)
        assert own is not None, name
        for imported in imports(name, path, known):
            layer = placed(imported, found)
            if layer is not None and layer > own:
                upward.append(f"{name} (layer {own}) imports {imported} (layer {layer})")
    assert not upward, upward


def test_the_layer_check_finds_an_upward_import():
    found = layers("## A: `normkit.spec`\n## B: `normkit.torch`, `normkit._pallas`\n")
    assert placed("normkit.torch.kernels.cpu", found) == 1
    assert placed("normkit.spec", found) == 0 and placed("normkit.bench", found) is None
