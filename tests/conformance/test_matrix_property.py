"""`normkit conformance` tells every field of the spec apart: a target that computes, for every
case, the reference of the case's spec changed in one field fails the matrix, default and full.

(Another ``axis`` is left out: every case gives parameters of the spec's shape, and a spec
with other axes takes parameters of another.) The target is the reference itself (tests/helpers/reference_fns.py), run in this process
through the matrix's cases and the worker's comparison, so each change costs only numpy.
"""

import pytest

from normkit.conformance.cases import Case, lean, matrix
from normkit.conformance.compare import compare
from normkit.spec import NormSpec
from tests.helpers.reference_fns import changed_outputs

# field -> the change made to every case's spec (a spec it does not apply to is left as it is)
CHANGES = {
    "kind to rms": lambda s: s.replace(kind="rms", p=None),
    "kind to layer": lambda s: s.replace(kind="layer", p=None),
    "kind to partial_rms": lambda s: s.replace(kind="partial_rms", p=0.5),
    "eps x10": lambda s: s.replace(eps=s.eps * 10),
    "eps /10": lambda s: s.replace(eps=s.eps / 10),
    "eps_placement flipped": lambda s: s.replace(
        eps_placement="outside" if s.eps_placement == "inside" else "inside"),
    "p doubled": lambda s: s.replace(p=min(1.0, 2 * s.p)),
    "scale dropped": lambda s: s.replace(scale=False, scale_offset=0.0, offset_dtype="float32"),
    "scale_offset flipped": lambda s: s.replace(scale_offset=1.0 - s.scale_offset,
                                                offset_dtype="float32"),
    "bias flipped": lambda s: s.replace(bias=not s.bias),
    "cast flipped": lambda s: s.replace(
        cast="after_scale" if s.cast == "before_scale" else "before_scale"),
    "residual rounded": lambda s: s.replace(residual="rounded"),
    "residual float32": lambda s: s.replace(residual="float32"),
    "residual float32_normalized": lambda s: s.replace(residual="float32_normalized"),
    "variance fast": lambda s: s.replace(variance="fast"),
    "variance two_pass": lambda s: s.replace(variance="two_pass"),
    "offset_dtype flipped": lambda s: s.replace(
        offset_dtype="float32" if s.offset_dtype == "param" else "param"),
    "output_dtype flipped": lambda s: s.replace(
        output_dtype="input" if s.output_dtype == "promote" else "promote"),
    "alpha_init flipped": lambda s: s.replace(alpha_init=1.0 if s.alpha_init == 0.5 else 0.5),
    "backward flipped": lambda s: s.replace(
        backward="exact" if s.backward == "autograd" else "autograd"),
    "gate flipped": lambda s: s.replace(gate="after" if s.gate == "before" else "before"),
    "gate_activation flipped": lambda s: s.replace(
        gate_activation="silu" if s.gate_activation == "sigmoid" else "sigmoid"),
    "group_size halved": lambda s: s.replace(group_size=s.group_size // 2),
    "group_size dropped": lambda s: s.replace(group_size=None),
}


def changed(change, case: Case) -> NormSpec | None:
    """The case's spec changed, where that is a valid spec of the same arguments and shapes."""
    spec = case.spec
    keeps_arguments = ("residual", "gate")
    try:
        new = change(spec)
    except (ValueError, TypeError):  # the field does not apply (eps of DyT, p of RMSNorm, ...)
        return None
    if new == spec or any((getattr(new, f) is None) != (getattr(spec, f) is None)
                          for f in keeps_arguments) or (new.kind == "dyt") != (spec.kind == "dyt"):
        return None
    try:
        new.group_count(int(__import__("math").prod(new.param_shape(case.shape))))
    except ValueError:
        return None
    return new if new.param_shape(case.shape) == spec.param_shape(case.shape) else None


def first_failure(change, cases):
    """The first case a target of the changed specs fails, or None."""
    for case in cases:
        new = changed(change, case)
        if new is None:
            continue
        inputs = case.arrays()
        problems, _ = compare(case.spec, inputs, changed_outputs(new, case.spec, inputs),
                              rows=case.rows)
        if problems:
            return case
    return None


@pytest.mark.parametrize("quick", [True, False], ids=["default", "full"])
def test_the_reference_passes_the_matrix(quick):
    for case in matrix(quick=quick)[:: 1 if quick else 7]:
        inputs = case.arrays()
        problems, _ = compare(case.spec, inputs, changed_outputs(case.spec, case.spec, inputs),
                              rows=case.rows)
        assert problems == [], case.label


MATRICES = {
    "default": lambda: matrix(quick=True),
    "full": lambda: matrix(),
    "lean": lambda: lean(matrix(quick=True)),  # the default of the targets that compile
}


@pytest.mark.parametrize("which", list(MATRICES))
@pytest.mark.parametrize("name", list(CHANGES))
def test_every_single_field_change_fails_the_matrix(name, which):
    assert first_failure(CHANGES[name], MATRICES[which]()) is not None, name


def test_every_field_is_changed():
    # every case gives parameters of the spec's shape: another axis takes other arguments
    fields = {name.split(" ")[0] for name in CHANGES}
    assert fields == set(NormSpec.__dataclass_fields__) - {"axis"}
