"""The package metadata: one version, the license, the typing marker, extras that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import normkit

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]


def requirement_names(extra: str) -> set[str]:
    """The distribution names an extra asks for, ``normkit[...]`` expanded."""
    names: set[str] = set()
    for requirement in EXTRAS[extra]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)[0]  # type: ignore[index]
        if name == "normkit":
            inner = re.search(r"\[(.*)\]", requirement)[1]  # type: ignore[index]
            for sub in inner.split(","):
                names |= requirement_names(sub.strip())
        else:
            names.add(name.lower())
    return names


def test_the_version_is_written_once():
    assert normkit.__version__ == PROJECT["version"]
    written = [
        path for path in (ROOT / "normkit").rglob("*.py")
        if re.search(r"""__version__\s*=\s*["']""", path.read_text())
    ]
    assert written == []


@pytest.mark.parametrize(
    ("with_pyproject", "expected"), [(True, PROJECT["version"]), (False, "0+unknown")]
)
def test_a_source_tree_that_is_not_installed_has_a_version(tmp_path, with_pyproject, expected):
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "normkit", tmp_path / "normkit", ignore=ignore)
    if with_pyproject:
        shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    code = (
        "from importlib import metadata\n"
        "def not_installed(name):\n"
        "    raise metadata.PackageNotFoundError(name)\n"
        "metadata.version = not_installed\n"
        "import normkit\n"
        "print(normkit.__file__, normkit.__version__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    where, version = done.stdout.split()
    assert Path(where).is_relative_to(tmp_path) and version == expected


def test_license_and_typing_marker_ship():
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert (ROOT / "normkit" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["normkit"]
    assert "Typing :: Typed" in PROJECT["classifiers"]
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])  # PEP 639


def test_extras():
    assert "tensorflow" not in requirement_names("keras")
    assert {"keras", "jax"} <= requirement_names("keras")
    assert {"mkdocs", "mkdocstrings"} <= requirement_names("docs")
    assert "pytest" in requirement_names("test")
    every = ("torch", "tf", "jax", "keras", "triton", "port", "bench")
    assert set().union(*(requirement_names(extra) for extra in every)) <= requirement_names("all")


def test_every_extra_named_by_the_code_and_the_readme_exists():
    named = set()
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for path in [*(ROOT / "normkit").rglob("*.py"), *pages]:
        for inner in re.findall(r"""(?:normkit|\.)\[([a-z,-]+)\]'""", path.read_text()):
            named |= set(inner.split(","))
    assert {"torch", "tf", "jax"} <= named
    assert named <= set(EXTRAS), f"extras named but not defined: {sorted(named - set(EXTRAS))}"


def test_the_sdist_holds_what_the_tests_read():
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    for folder, pattern in (("examples", "*.py"), ("tests", "*.py"), ("docs", "*.md")):
        assert any(line.startswith(f"recursive-include {folder} ") and pattern in line.split()
                   for line in manifest), folder
