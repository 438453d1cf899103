"""normkit.tf's conformance hook (normkit.conformance.targets_keras) on the conformance matrix's
own cases (the reference checks of every option are tests/tf/test_tf_backend.py;
test_tf_keras.py runs them on JAX and torch too)."""

import pytest

from normkit import reference, tolerances
from normkit.conformance.cases import matrix
from normkit.conformance.targets_keras import evaluate, keras_backend

_ONE_ELEMENT_ROWS = [c for c in matrix(kinds=("rms", "partial_rms")) if c.shape[-1] == 1]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_conformance_matrix_rows_of_one_element(dtype, jit):
    """The matrix's n = 1 cases of the RMS kinds (every placement, offset, bias and cast), with the
    matrix's own inputs: dx = d eps r^3 (inside) or d eps r^2 (outside) within the bound."""
    if jit and keras_backend() == "torch":
        pytest.skip("the torch Keras backend has no jit")
    cases = [c for c in _ONE_ELEMENT_ROWS if c.dtype == dtype]
    assert len(cases) == (8 if dtype == "float32" else 16) * 2
    for case in cases:
        x, dy, scale, bias = case.inputs()
        _, dx, dscale, _ = evaluate(case.spec, x, dy, scale, bias, jit=jit)
        rdx, rdscale, _ = reference.normalize_vjp(x, dy, case.spec, scale, bias)
        tolerances.assert_close(dx, rdx, x.dtype, quantity="grad", what=f"dx {case.label}")
        tolerances.assert_close(dscale, rdscale, quantity="grad", what=f"dscale {case.label}")
