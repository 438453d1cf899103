"""docs/architecture.md's recipes name every file they must: the files of normkit/ that branch
on a norm kind (a new kind touches each), and the modules of the harness and the tools that
switch on a backend's name (a new framework touches each)."""

import re
from pathlib import Path

import normkit
from normkit import backends

ROOT = Path(normkit.__file__).parent
ARCHITECTURE = (ROOT.parent / "docs" / "architecture.md").read_text()

NAMES_A_KIND = re.compile(
    r"""(kind|Kind)[^\n]*["'](rms|partial_rms|layer)["']|["'](rms|partial_rms|layer)["'][^\n]*"""
    r"""\bkind\b|GROUPABLE_KINDS|\bKINDS\b"""
)
"""A comparison or a table that names one of the normalization kinds (DyT's own switches read
its alpha, which a new kind has none of)."""

FRAMEWORKS = ("torch", "tf", "jax", "flax", "keras")
_NAMES = "|".join(FRAMEWORKS)
SWITCHES_ON_A_BACKEND = re.compile(rf"""(==|!=) *["']({_NAMES})["']|["']({_NAMES})["'] *:""")


def section(title: str) -> str:
    start = ARCHITECTURE.index(f"### {title}")
    end = ARCHITECTURE.find("\n### ", start + 1)
    return ARCHITECTURE[start:] if end < 0 else ARCHITECTURE[start:end]


def files(pattern: re.Pattern[str]) -> list[str]:
    return sorted(
        str(path.relative_to(ROOT.parent)) for path in ROOT.rglob("*.py")
        if pattern.search(path.read_text())
    )


def named(path: str, text: str) -> bool:
    """``path`` is in ``text``, itself or as its folder's ``<name>.py`` (a framework's own
    module: normkit/bench/jax.py is named by normkit/bench/<name>.py)."""
    folder, _, stem = path.rpartition("/")
    generic = stem.removesuffix(".py") in FRAMEWORKS and f"`{folder}/<name>.py`" in text
    return f"`{path}`" in text or generic


def test_the_kind_recipe_names_every_file_that_branches_on_a_kind():
    found = files(NAMES_A_KIND)
    assert "normkit/spec.py" in found and "normkit/torch/_eager.py" in found
    recipe = section("A new norm kind")
    missing = [path for path in found if not named(path, recipe)]
    assert not missing, f"docs/architecture.md's recipe for a new kind omits {missing}"


def test_the_framework_recipe_names_every_switch_on_a_backend():
    adapters = tuple(b.module.replace(".", "/") + "/" for b in backends.BACKENDS)
    found = [path for path in files(SWITCHES_ON_A_BACKEND) if not path.startswith(adapters)]
    assert "normkit/testing.py" in found and "normkit/backends.py" in found
    recipe = section("A new framework")
    missing = [path for path in found if not named(path, recipe)]
    assert not missing, f"docs/architecture.md's recipe for a new framework omits {missing}"


def test_the_recipe_check_sees_a_missing_file():
    assert not named("normkit/torch/_eager.py", "`normkit/torch/_plan.py`")
    assert named("normkit/bench/jax.py", "a hook, `normkit/bench/<name>.py`")
    assert not named("normkit/bench/core.py", "`normkit/bench/<name>.py`")
