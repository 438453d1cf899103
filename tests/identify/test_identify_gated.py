"""identify_gated: each Hugging Face gated norm class, and normkit's own gated norms, identified
from probing (the gate's position and activation, the groups, then the norm inside)."""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")

from normkit import NormSpec  # noqa: E402
from normkit.identify import identify_gated  # noqa: E402
from normkit.port.gated_classes import GATED_CLASSES  # noqa: E402
from normkit.torch.functional import normalize  # noqa: E402

HIDDEN = 64
GROUPS = {"group_size": 16, "n_groups": 4}  # 4 groups of 16 either way


def _fields(spec: NormSpec) -> dict:
    return {k: v for k, v in spec.to_dict().items() if k != "backward"}


@pytest.mark.parametrize(
    "entry", GATED_CLASSES, ids=lambda e: e.name + "".join(f"-{v}" for _, v in e.options)
)
def test_each_hf_gated_class_is_identified_as_its_table_spec(entry):
    pytest.importorskip("transformers")
    try:
        cls = getattr(importlib.import_module(entry.module), entry.name)
    except (ImportError, AttributeError):
        pytest.skip(f"{entry.module}.{entry.name} is not in the installed transformers")
    options = dict(entry.options)
    if entry.groups is not None:
        options[entry.groups] = GROUPS[entry.groups]
    module = cls(HIDDEN, **options).eval().requires_grad_(False)

    def fn(x, z, scale, bias):  # the weight stays float32, as a model's master weights do
        if scale is not None:  # None: the module's own
            module.weight.copy_(scale)
        return module(x.unsqueeze(0), z.unsqueeze(0)).squeeze(0)

    found = identify_gated(fn, (HIDDEN,), backend="torch", params=True)
    groups = None if entry.groups is None else GROUPS[entry.groups]
    assert _fields(found.spec) == _fields(entry.spec_for(HIDDEN, 1e-6, groups))
    assert found.undetermined == ("backward",), found.describe()


SPECS = [
    NormSpec("layer", eps=1e-5, gate="before", gate_activation="sigmoid", group_size=8),
    NormSpec("partial_rms", p=0.25, gate="after", cast="before_scale"),
    NormSpec("rms", eps=1e-4, eps_placement="outside", gate="before", bias=True),
    NormSpec("rms", gate="after", gate_activation="sigmoid", group_size=32, scale_offset=1.0),
]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_normkits_own_gated_norms_are_identified(spec):
    def fn(x, z, scale, bias):
        return normalize(x, spec, scale, bias if spec.bias else None, gate=z)

    found = identify_gated(fn, (HIDDEN,), backend="torch", params=True)
    assert _fields(found.spec) == _fields(spec.replace(axis=(-1,))), found.describe()


def test_an_ungated_norm_or_another_activation_is_refused():
    plain = NormSpec()
    with pytest.raises(ValueError, match="does not depend on the gate"):
        identify_gated(lambda x, z: normalize(x, plain), (HIDDEN,), backend="torch")
    tanh_after = lambda x, z: normalize(x, plain) * torch.tanh(z)  # noqa: E731
    with pytest.raises(ValueError, match="neither SiLU"):
        identify_gated(tanh_after, (HIDDEN,), backend="torch")
