"""The install commands normkit prints name the extras that install what is missing."""

import re
import tomllib
from pathlib import Path

import pytest

from normkit.backends import EXTRAS, install_hint
from normkit.conformance.targets import TARGETS

PYPROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())


def test_the_extras_table_is_pyprojects():
    declared = PYPROJECT["project"]["optional-dependencies"]
    for extra, packages in EXTRAS.items():
        names = {re.split(r"[<>=;\[ ]", p)[0] for p in declared[extra]}
        assert names == set(packages), extra


@pytest.mark.parametrize(
    "target, hint",
    [
        ("torch", "pip install 'normkit[torch]'"),
        ("torch[cpu-kernel]", "pip install 'normkit[torch]'"),  # the torch extra has numba
        ("torch[triton]", "pip install 'normkit[torch,triton]'"),
        ("tf[tensorflow]", "pip install 'normkit[tf]'"),
        ("tf[jax,jit]", "pip install 'normkit[keras]'"),  # keras with jax: the keras extra
        ("tf[torch]", "pip install 'normkit[torch]' keras"),
        ("jax.linen", "pip install 'normkit[jax]'"),
    ],
)
def test_each_target_names_its_extras(target, hint):
    assert next(t for t in TARGETS if t.name == target).install == hint


def test_packages_no_extra_installs_are_named():
    assert install_hint(["torch"], ["transformers"]) == "pip install 'normkit[torch]' transformers"
    assert install_hint([], ["safetensors"]) == "pip install 'normkit[port]'"


def test_keras_on_jax_needs_no_flax():
    target = next(t for t in TARGETS if t.name == "tf[jax,jit]")
    assert set(target.requires) == {"keras", "jax"}
