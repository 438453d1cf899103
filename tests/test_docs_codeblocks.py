"""The docs as a reader meets them: every ```python block in README.md and docs/ runs as pasted,
the examples in the main docstrings pass as doctests, and every relative link points at a file
of the repository.

Each block runs in a fresh namespace, in a temporary working directory (blocks may write files).
A block whose frameworks are not installed is skipped with the missing one named; which
frameworks a block needs is read from its imports (``normkit.torch`` needs torch, and so on) and
from a ``.safetensors`` file name (the safetensors package). A block that is intentionally not
runnable is preceded by the line ``<!-- not run: REASON -->`` and reported as skipped.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)|!\[[^\]]*\]\((?P<image>[^)\s]+)\)")
# What importing a normkit module needs beyond numpy; the longest matching prefix wins.
NEEDS = {
    "normkit.torch": ("torch",),
    "normkit.tf": ("keras",),
    "normkit.jax": ("jax", "flax"),
    "normkit.port.torch": ("torch",),
    "normkit.port.huggingface": ("torch",),
    "normkit.port.keras": ("keras",),
    "normkit.port.flax": ("jax", "flax"),
    "normkit.bench.plot": ("matplotlib",),
}
EXTRA = {"torch": "torch", "keras": "tf", "tensorflow": "tf", "jax": "jax", "flax": "jax",
         "safetensors": "port", "matplotlib": "bench"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    source: str
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` whose info string starts with ``python``."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match["info"].strip().split(" ")[0] != "python":
            continue
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = NOT_RUN.search(before)
        blocks.append(Block(page, line, match["body"], marker["reason"] if marker else None))
    return blocks


def needed_modules(source: str) -> list[str]:
    """The top-level modules a block needs installed, from its imports."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    needed: list[str] = []
    for name in names:
        prefixes = [p for p in NEEDS if name == p or name.startswith(p + ".")]
        if prefixes:
            needed += NEEDS[max(prefixes, key=len)]
        elif not name.startswith("normkit"):
            needed.append(name.split(".")[0])
    if "keras" in needed:
        needed.append(os.environ.get("KERAS_BACKEND", "tensorflow"))
    if re.search(r"\.safetensors\b", source):
        needed.append("safetensors")
    return list(dict.fromkeys(needed))


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


def test_the_pages_have_python_blocks():
    pages = {block.page.name for block in BLOCKS}
    assert {"README.md", "torch.md", "jax.md", "tf.md", "porting.md"} <= pages
    assert sum(block.not_run is not None for block in BLOCKS) <= 2, "unrunnable blocks must be rare"


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_python_block_runs_as_pasted(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if block.not_run is not None:
        pytest.skip(f"marked not run: {block.not_run}")
    needed = needed_modules(block.source)
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        extras = sorted({EXTRA.get(name, name) for name in missing})
        pytest.skip(f"needs {', '.join(missing)}: pip install '.[{','.join(extras)}]'")
    monkeypatch.chdir(tmp_path)
    code = compile(block.source, block.name, "exec")
    exec(code, {"__name__": "__docs__"})  # noqa: S102 (running the docs' own examples)


DOCTESTED = ["normkit.spec", "normkit.reference", "normkit.torch.modules", "normkit.tf.layers",
             "normkit.jax.linen", "normkit.jax.nnx"]


@pytest.mark.parametrize("module_name", DOCTESTED)
def test_docstring_examples_pass(module_name: str):
    missing = [name for name in needed_modules(f"import {module_name}")
               if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    module = importlib.import_module(module_name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0, f"{module_name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} docstring example(s) of {module_name} failed"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    anchors = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


LINKS = [
    (page, match["target"] or match["image"])
    for page in PAGES
    for match in LINK.finditer(FENCE.sub("", page.read_text()))
    if not re.match(r"[a-z]+:", match["target"] or match["image"])  # absolute URLs: not offline
]


@pytest.mark.parametrize(
    ("page", "target"), LINKS, ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in LINKS]
)
def test_relative_link_points_into_the_repository(page: Path, target: str):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
    assert resolved.exists(), f"{page.name}: {target} does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in heading_anchors(resolved), f"{page.name}: {target}: no such heading"


def test_link_checker_finds_a_dangling_link(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("see [a](missing.md) and ![b](img.png)\n```sh\n[not](a-link.md)\n```\n")
    found = [m["target"] or m["image"] for m in LINK.finditer(FENCE.sub("", page.read_text()))]
    assert found == ["missing.md", "img.png"]
