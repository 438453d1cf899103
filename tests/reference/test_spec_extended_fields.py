"""NormSpec's residual, variance, offset_dtype, output_dtype, DyT, backward, gate and
group_size fields."""

import dataclasses
import json

import pytest

from normkit import NormSpec
from normkit.spec import DEFAULT_ALPHA_INIT, DEFAULT_EPS, EXTENDED_DEFAULTS


def test_defaults_leave_existing_specs_unchanged():
    spec = NormSpec()
    assert (spec.eps, spec.eps_placement, spec.variance) == (1e-6, "inside", "two_pass")
    assert (spec.residual, spec.offset_dtype, spec.output_dtype) == (
        None,
        "float32",
        "input",
    )
    assert (spec.alpha_init, spec.backward) == (None, "exact")
    assert (spec.gate, spec.gate_activation, spec.group_size) == (None, None, None)
    assert NormSpec("layer").variance == "two_pass"
    assert NormSpec("partial_rms", p=0.5).eps == DEFAULT_EPS


def test_dyt_resolves_its_own_defaults_and_has_no_statistic_fields():
    spec = NormSpec("dyt")
    assert (spec.eps, spec.eps_placement, spec.p, spec.variance) == (
        None,
        None,
        None,
        None,
    )
    assert spec.alpha_init == DEFAULT_ALPHA_INIT == 0.5
    assert spec.bias is True and spec.scale is True
    assert NormSpec("dyt", alpha_init=1, bias=False).alpha_init == 1.0


@pytest.mark.parametrize(
    "kwargs, field, detail",
    [
        ({"residual": "bf16"}, "residual", "None or one of"),
        ({"residual": True}, "residual", "None or one of"),
        ({"kind": "layer", "variance": "welford"}, "variance", "one of"),
        ({"variance": "fast"}, "variance", "only to kind='layer'"),
        (
            {"kind": "partial_rms", "p": 0.5, "variance": "fast"},
            "variance",
            "only to kind='layer'",
        ),
        ({"offset_dtype": "bfloat16"}, "offset_dtype", "one of"),
        ({"offset_dtype": "param"}, "offset_dtype", "non-zero scale_offset"),
        ({"output_dtype": "float32"}, "output_dtype", "one of"),
        ({"backward": "fused"}, "backward", "one of"),
        ({"alpha_init": 0.5}, "alpha_init", "only to kind='dyt'"),
        ({"kind": "layer", "alpha_init": 1.0}, "alpha_init", "only to kind='dyt'"),
        ({"kind": "dyt", "alpha_init": 0.0}, "alpha_init", "positive finite"),
        ({"kind": "dyt", "alpha_init": -1.0}, "alpha_init", "positive finite"),
        ({"kind": "dyt", "alpha_init": float("inf")}, "alpha_init", "positive finite"),
        ({"kind": "dyt", "alpha_init": "0.5"}, "alpha_init", "positive finite"),
        ({"kind": "dyt", "alpha_init": True}, "alpha_init", "positive finite"),
        ({"kind": "dyt", "eps": 1e-6}, "eps", "no statistic"),
        ({"kind": "dyt", "eps_placement": "inside"}, "eps_placement", "no statistic"),
        ({"kind": "dyt", "p": 0.5}, "p", "no statistic"),
        ({"kind": "dyt", "variance": "two_pass"}, "variance", "no statistic"),
        ({"kind": "dyt", "cast": "before"}, "cast", "one of"),
        (
            {"kind": "dyt", "scale": False, "scale_offset": 1.0},
            "scale_offset",
            "needs scale=True",
        ),
        ({"kind": "norm"}, "kind", "'dyt'"),
    ],
)
def test_invalid_extended_field_names_field_and_value(kwargs, field, detail):
    with pytest.raises(ValueError) as info:
        NormSpec(**kwargs)
    message = str(info.value)
    assert f"NormSpec.{field}={kwargs.get(field)!r}" in message
    assert detail in message


EXTENDED = [
    NormSpec(residual="rounded"),
    NormSpec("layer", residual="float32_normalized", variance="fast", eps=1e-5),
    NormSpec(scale_offset=1.0, offset_dtype="param", output_dtype="promote"),
    NormSpec(cast="before_scale", backward="autograd", residual="float32"),
    NormSpec("dyt", alpha_init=1.0, axis=(-2, -1), bias=False, cast="before_scale"),
    NormSpec("layer", gate="before", gate_activation="sigmoid", group_size=16,
             output_dtype="promote"),
]


@pytest.mark.parametrize("spec", EXTENDED, ids=repr)
def test_dict_round_trip_through_json_frozen_and_hashable(spec):
    restored = NormSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert restored == spec and hash(restored) == hash(spec)
    assert len({spec, restored}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.residual = None  # type: ignore[misc]


def test_dict_written_before_the_extended_fields_gets_their_defaults():
    old = {
        "kind": "layer",
        "eps": 1e-5,
        "eps_placement": "inside",
        "p": None,
        "axis": [-1],
        "scale": True,
        "scale_offset": 0.0,
        "bias": True,
        "cast": "after_scale",
    }
    spec = NormSpec.from_dict(old)
    assert spec == NormSpec("layer", eps=1e-5)
    assert (spec.residual, spec.variance, spec.offset_dtype) == (
        None,
        "two_pass",
        "float32",
    )
    assert (spec.output_dtype, spec.alpha_init, spec.backward) == (
        "input",
        None,
        "exact",
    )
    assert set(spec.to_dict()) == set(old) | set(EXTENDED_DEFAULTS) | {"alpha_init"}


def test_replace_between_kinds():
    assert NormSpec().replace(kind="layer", bias=None).variance == "two_pass"
    assert NormSpec("layer").replace(kind="rms").variance == "two_pass"
    with pytest.raises(ValueError, match=r"NormSpec.eps=1e-06 is invalid: kind='dyt'"):
        NormSpec().replace(kind="dyt")
    dyt = NormSpec().replace(kind="dyt", eps=None, eps_placement=None, variance=None)
    assert dyt == NormSpec("dyt", bias=False)
    with pytest.raises(ValueError, match=r"NormSpec.variance='fast' is invalid"):
        NormSpec("layer", variance="fast").replace(kind="rms")


def test_require_defaults_names_the_first_extended_field():
    NormSpec("layer", eps=1e-5, cast="before_scale").require_defaults("impl")
    with pytest.raises(ValueError, match=r"^impl does not support NormSpec.kind='dyt'"):
        NormSpec("dyt").require_defaults("impl")
    for spec in EXTENDED[:4]:
        name = next(f for f, d in EXTENDED_DEFAULTS.items() if getattr(spec, f) != d)
        value = getattr(spec, name)
        with pytest.raises(
            ValueError, match=rf"impl does not support NormSpec.{name}={value!r}"
        ):
            spec.require_defaults("impl")
