"""`assert_conforms` tells every field of the spec apart.

For a compact grid of specs and every single-field change of each that computes a different
function of the same arguments, the reference of the changed spec (an implementation that
follows the changed spec exactly: tests/helpers/reference_fns.py) fails `assert_conforms` against
the original in every dtype the change shows in, and the original's own reference passes.
Where a change shows is stated per field in `visible_in`, from the semantics (docs/semantics.md);
changes that alter the arguments ``fn`` takes (a residual or a gate added or removed, a kind to
or from DyT) are not functions of the same arguments and are left out.
"""

import math

import pytest

from normkit import NormSpec
from normkit.testing import _checked_arguments, _default_shapes, _failures, assert_conforms

torch = pytest.importorskip("torch")
from tests.helpers.reference_fns import torch_reference  # noqa: E402 - needs torch

DTYPES = ("float32", "float16", "bfloat16", "float64")
HALVES = ("float16", "bfloat16")

# (spec, params, param_dtype): each field's values, both placements and offsets, a residual, a
# gate and groups, DyT, the Llama cast order with autograd's gradients.
GRID = [
    (NormSpec("rms", eps=1e-6), True, "float32"),
    (NormSpec("layer", eps=1e-5, cast="before_scale"), True, "float32"),
    (NormSpec("partial_rms", p=0.25, eps=1e-5, eps_placement="outside", scale_offset=1.0,
              bias=True), True, "float32"),
    (NormSpec("rms", scale_offset=1.0, offset_dtype="param", cast="before_scale"), True, "input"),
    (NormSpec("rms", cast="before_scale", backward="autograd"), True, "input"),
    (NormSpec("rms", residual="rounded", axis=(-2, -1)), False, "float32"),
    (NormSpec("layer", residual="float32_normalized", output_dtype="promote"), True, "float32"),
    (NormSpec("layer", variance="fast"), False, "float32"),
    (NormSpec("rms", gate="after", cast="before_scale"), False, "float32"),
    (NormSpec("layer", gate="before", gate_activation="sigmoid", group_size=4), True, "float32"),
    (NormSpec("dyt"), False, "float32"),
    (NormSpec("dyt", alpha_init=1.0, bias=False), True, "float32"),
]

ALTERNATIVES = {
    "kind": ("rms", "layer", "partial_rms"),
    "eps": "x10",
    "eps_placement": ("inside", "outside"),
    "p": (0.25, 0.5),
    "axis": ((-1,), (-2, -1)),
    "scale": (True, False),
    "scale_offset": (0.0, 1.0),
    "bias": (True, False),
    "cast": ("after_scale", "before_scale"),
    "residual": ("rounded", "float32", "float32_normalized"),
    "variance": ("two_pass", "fast"),
    "offset_dtype": ("float32", "param"),
    "output_dtype": ("input", "promote"),
    "alpha_init": (0.5, 1.0),
    "backward": ("exact", "autograd"),
    "gate": ("before", "after"),
    "gate_activation": ("silu", "sigmoid"),
    "group_size": (None, 2, 4),
}


def defined_on(changed: NormSpec, spec: NormSpec, params: bool) -> bool:
    """Whether ``changed`` computes on ``spec``'s inputs: whole groups, and parameters of the
    shape ``spec`` gives (another axis with params, or groups that do not divide the row, make a
    function of other arguments)."""
    for shape in _default_shapes(spec):
        try:
            changed.group_count(math.prod(changed.param_shape(shape)))
        except ValueError:
            return False
        if params and changed.param_shape(shape) != spec.param_shape(shape):
            return False
    return True


def changes(spec: NormSpec, params: bool):
    """Every valid single-field change of ``spec`` that keeps ``fn``'s arguments."""
    for name, values in ALTERNATIVES.items():
        current = getattr(spec, name)
        if values == "x10":
            values = (current * 10, current / 10) if current is not None else ()
        for value in values:
            if value == current or (name in ("residual", "gate") and current is None):
                continue
            extra = {"p": 0.25} if name == "kind" and value == "partial_rms" else {}
            if name == "kind" and spec.kind == "partial_rms":
                extra = {"p": None}
            try:
                changed = spec.replace(**{name: value}, **extra)
            except ValueError:
                continue
            if defined_on(changed, spec, params):
                yield name, changed


def param_dtype_of(dtype: str, params: bool, param_dtype: str) -> str:
    if not params:
        return "float32"  # absent parameters count as float32 (the layer's initial ones)
    return dtype if param_dtype == "input" else param_dtype


WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def promotes(dtype: str, param: str) -> bool:
    """Whether the promoted dtype of ``dtype`` and ``param`` is not ``dtype``."""
    return WIDTH[param] > WIDTH[dtype] or (param != dtype and WIDTH[param] == 16 == WIDTH[dtype])


def visible_in(name, spec, changed, params, param_dtype) -> set[str]:
    """The dtypes in which the change of field ``name`` shows, from the semantics."""
    if name in ("kind", "eps", "eps_placement", "p", "gate", "gate_activation", "group_size"):
        return set(DTYPES)
    if name == "axis":  # DyT's axes are those of its parameters, here at their initial values
        return set() if spec.kind == "dyt" else set(DTYPES)
    if name == "alpha_init":  # with params, alpha is given and its initial value is unused
        return set() if params else set(DTYPES)
    if name in ("scale", "scale_offset"):  # a scale given and ignored, or offset by 1
        return set(DTYPES) if params and spec.scale else set()
    if name == "bias":  # a bias given and ignored (without one given, b = 0 either way)
        return set(DTYPES) if params and spec.bias else set()
    if name == "cast":  # half inputs, where w is not 1 or a gate multiplies after the norm
        return set(HALVES) if params or spec.gate == "after" else set()
    if name == "residual":  # the three coincide for float32 and float64 inputs
        return set(HALVES)
    if name == "variance":  # large-mean rows, where bfloat16's variances are exact; a fast
        # spec can be held to them only on float16 rows short enough for exact sums
        if spec.variance == "fast":
            short = any(math.prod(spec.param_shape(s)) <= 16 for s in _default_shapes(spec))
            return {"float16"} if short else set()
        return {"float32", "float16", "float64"}
    if name == "offset_dtype":  # 1 + w rounded in a half parameter dtype
        return {d for d in DTYPES if params and param_dtype_of(d, params, param_dtype) in HALVES}
    if name == "output_dtype":  # promotion changes the dtype where the parameters are wider
        return {d for d in DTYPES if promotes(d, param_dtype_of(d, params, param_dtype))}
    if name == "backward":  # autograd's roundings: half inputs with the Llama cast order
        return set(HALVES) if spec.cast == "before_scale" else set()
    raise AssertionError(f"no rule for {name}")


CHANGES = [
    (spec, params, param_dtype, name, changed)
    for spec, params, param_dtype in GRID
    for name, changed in changes(spec, params)
    if visible_in(name, spec, changed, params, param_dtype)
]


def failing_dtypes(fn, spec, params, param_dtype, dtypes=DTYPES):
    names, sizes = _checked_arguments(spec, dtypes, _default_shapes(spec))
    found = _failures(fn, spec, "torch", names, sizes, True, params, param_dtype, "cpu")
    return {f.dtype for f in found}


@pytest.mark.parametrize("spec, params, param_dtype", GRID, ids=[repr(g[0]) for g in GRID])
def test_the_reference_of_a_spec_conforms_to_it(spec, params, param_dtype):
    fn = torch_reference(spec, spec, params)
    assert failing_dtypes(fn, spec, params, param_dtype) == set()


@pytest.mark.parametrize(
    "spec, params, param_dtype, name, changed", CHANGES,
    ids=[f"{c[0]!r}-{c[3]}-{c[4]!r}" for c in CHANGES],
)
def test_every_single_field_change_fails_in_every_dtype_it_shows_in(
    spec, params, param_dtype, name, changed
):
    fn = torch_reference(changed, spec, params)
    visible = visible_in(name, spec, changed, params, param_dtype)
    assert failing_dtypes(fn, spec, params, param_dtype, sorted(visible)) == visible


def test_every_field_is_changed_somewhere():
    assert {name for *_, name, _ in CHANGES} == set(ALTERNATIVES)


def t5_rms(x, weight, bias=None):  # T5, Gemma, Qwen: eps 1e-6 OUTSIDE the square root
    h = x.float()
    return (h / (h.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6) * weight).to(x.dtype)


def test_the_issue_s_eps_outside_fails_at_eps_1e_6_naming_the_placement():
    with pytest.raises(AssertionError) as info:
        assert_conforms(t5_rms, NormSpec("rms", eps=1e-6), params=True, backend="torch")
    lines = str(info.value).splitlines()
    assert lines[1] == (
        "Likely difference (identify's reading of t5_rms): eps_placement='outside', not "
        "'inside' (identify: eps 1e-06 (outside the sqrt))"
    )
    assert lines[2] == "Worst first:" and "rows near eps: y: FAIL" in lines[3]


@pytest.mark.parametrize(
    "spec, changed, params, param_dtype, expected",
    [
        (NormSpec("layer"), NormSpec("layer", variance="fast"), False, "float32",
         "variance='fast', not 'two_pass'"),
        (NormSpec("rms", eps=1e-5), NormSpec("rms", eps=1e-6), True, "float32",
         "eps=1e-06, not 1e-05"),
        (NormSpec("rms", scale_offset=1.0), NormSpec("rms"), True, "float32",
         "scale_offset=0.0, not 1.0"),
        (NormSpec("rms", cast="before_scale", backward="autograd"),
         NormSpec("rms", cast="before_scale"), True, "input", "only gradients fail (dx"),
    ],
)
def test_the_message_names_the_likely_difference_first(
    spec, changed, params, param_dtype, expected
):
    with pytest.raises(AssertionError) as info:
        assert_conforms(torch_reference(changed, spec, params), spec, backend="torch",
                        params=params, param_dtype=param_dtype)
    assert expected in str(info.value).splitlines()[1]


def test_the_traceback_ends_at_the_callers_assertion():
    with pytest.raises(AssertionError) as info:
        assert_conforms(t5_rms, NormSpec("rms", eps=1e-6), params=True, backend="torch",
                        dtypes=("float32",))
    entries = info.traceback
    assert entries[-1].frame.code.name == "assert_conforms"
    assert entries[-1].ishidden(info)  # pytest hides it: the user's line is the last shown
    assert info.value.__cause__ is None and info.value.__suppress_context__
