"""normkit.tf's rows at the edges keep to themselves, as the reference's do (tests/helpers/
edge_rows.py: a row sent to the guarded program beside one whose ``sum(dy x)`` overflows, a NaN
in a partial RMS row's tail, the gate's SiLU below z = -88.7), and float64 is computed in
float64. pytest runs them on the TensorFlow backend; tests/tf/test_tf_keras.py runs this file
again with KERAS_BACKEND=jax and =torch, each in its own process."""

from __future__ import annotations

import numpy as np
import pytest

# Keras imports its backend's framework (TensorFlow unless KERAS_BACKEND names another); where
# that is missing, the module skips with the missing module's name.
keras = pytest.importorskip("keras")

from normkit import NormSpec, reference  # noqa: E402
from normkit.conformance.cases import Case  # noqa: E402
from normkit.conformance.targets_keras import evaluate, keras_backend  # noqa: E402
from tests.helpers import edge_rows  # noqa: E402
from tests.helpers.targets import VARIANTS, check  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning"
)
JITS = [False] if keras_backend() == "torch" else [False, True]
jits = pytest.mark.parametrize("jit", JITS, ids=lambda j: "jit" if j else "eager")
# Every spec in float32; one in bfloat16 and float64.
NEIGHBOURS = [(s, "float32") for s in edge_rows.NEIGHBOUR_SPECS] + [
    (edge_rows.NEIGHBOUR_SPECS[0], d) for d in ("bfloat16", "float64")
]
NAN_TAILS = [(s, "float32") for s in edge_rows.NAN_TAIL_SPECS] + [
    (edge_rows.NAN_TAIL_SPECS[0], d) for d in ("bfloat16", "float64")
]


def _id(case: tuple[NormSpec, str]) -> str:
    return f"{edge_rows.spec_id(case[0])}-{case[1]}"


@jits
@pytest.mark.parametrize("case", NEIGHBOURS, ids=_id)
def test_a_row_in_the_guarded_program_leaves_its_neighbours_gradients_alone(case, jit):
    """Issue 48, defect 2: |x| 1e9 with |dy| 1e29 beside a row of 1e20 had a dx of inf or NaN
    (the guarded program's autodiff formed sum(dy x) apart from r'(s)); the reference's is
    about 1e20."""
    edge_rows.check_neighbours(evaluate, *case, jit=jit)


@jits
@pytest.mark.parametrize("case", NAN_TAILS, ids=_id)
def test_a_nan_in_a_partial_rows_tail_stays_out_of_the_rest_of_the_tail(case, jit):
    """Issue 48, defect 3: the whole row's dx was NaN (the head mask multiplied the row's NaN
    factor); the reference's is NaN on the first k elements only."""
    edge_rows.check_nan_tail(evaluate, *case, jit=jit)


@jits
@pytest.mark.parametrize("dtype", list(edge_rows.DTYPES))
@pytest.mark.parametrize("gate", ["after", "before"])
def test_the_gates_silu_below_minus_88_is_not_zero(gate, dtype, jit):
    """Issue 48, defect 5: ``z sigmoid(z)`` at z = -89 was 0 (1 / (1 + e^89) is), the
    reference's about 1e-37; dgate there too. Keras' torch backend keeps subnormals, so dx of
    ``gate="after"`` is checked there as well."""
    edge_rows.check_far_gate(
        evaluate, gate, dtype, keeps_subnormals=keras_backend() == "torch", jit=jit
    )


@jits
@pytest.mark.parametrize(
    "spec", [NormSpec(), NormSpec("layer"), NormSpec("partial_rms", p=0.5), NormSpec("dyt")],
    ids=lambda s: s.kind,
)
def test_float64_is_computed_in_float64(spec, jit):
    """Keras 3 computes ``ops.mean`` of float64 (and ``ops.tanh`` on JAX) in float32 on its
    JAX and torch backends: the layers' float64 results were float32's (errors 1e-8, and a
    cotangent of 1e-200 lost 10-50 % of dx)."""
    rng = np.random.default_rng(64)
    x = 3 * rng.standard_normal((3, 8))
    for scale in (1.0, 1e-200):
        dy = scale * rng.standard_normal(x.shape)
        y, dx, *_ = evaluate(spec, x, dy, jit=jit)
        grads = reference.normalize_vjp(x, dy, spec)
        want = reference.normalize(x, spec)
        assert y.dtype == dx.dtype == np.float64
        np.testing.assert_allclose(y, want, rtol=0, atol=1e-13 * np.abs(want).max())
        np.testing.assert_allclose(dx, grads.dx, rtol=0, atol=1e-13 * np.abs(grads.dx).max())


@jits
@pytest.mark.parametrize("shape", [(5, 7), (3, 16)], ids=lambda s: f"n{s[1]}")
@pytest.mark.parametrize(
    "spec", [NormSpec("layer", variance="fast"),
             NormSpec("layer", variance="fast", eps=1e-5, eps_placement="outside")],
    ids=["inside", "outside"],
)
def test_the_fast_variance_rounds_each_step_once_under_xla(spec, shape, jit):
    """The conformance probe's float16 rows of a large mean, whose squares and sums are exact in
    float32: XLA divided by n as a product by 1/n (an ulp of m2 off), so that y was 32 ulps off
    under jit_compile and jax.jit (eager TensorFlow, JAX and torch were right)."""
    inputs = Case(spec, shape, "float16", rows="large_mean").arrays()
    check(VARIANTS["tf[jit]" if jit else "tf"], spec, inputs)


@jits
@pytest.mark.parametrize(
    "spec", [NormSpec("layer", variance="fast", bias=True),
             NormSpec("layer", variance="fast", eps=1e-5, eps_placement="outside")],
    ids=["inside", "outside"],
)
@pytest.mark.parametrize("rows", ["overflowing_squares", "large_mean"])
def test_the_fast_variance_rounds_as_the_references_does(spec, rows, jit):
    """Rows whose squares overflow float32 (the reference's v is infinite: y = b; or NaN where
    m1^2 overflows too), and whose squares' sum alone overflows (an ordinary row there)."""
    edge_rows.check_fast_rows(evaluate, spec, rows, jit=jit)


@jits
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dyts_slope_is_kept_where_tanh_rounds_to_one(dtype, jit):
    """DyT's ``1 - tanh(u)^2`` (every backend's derivative of tanh) is 0 in float32 from
    |u| = 9 on: dx was 0 on rows of 30 + N(0, 1) with alpha 0.5, the reference's about 1e-12."""
    edge_rows.check_far_dyt(evaluate, dtype, jit=jit)


@jits
@pytest.mark.parametrize("spec", edge_rows.LARGE_MEAN_SPECS, ids=str)
def test_rows_of_a_large_mean_at_every_scale(spec, jit):
    """Rows s (10 + N(0, 1)), each row and group on its own: a mean above 1/r sent a row to
    the correction pass, which missed the rows far below sqrt(eps) (r is 1/sqrt(eps) there: y
    1.2e-6 of their max|y| off); and the rescaling's 1 / max|x| rounded every value before the
    centering (rows of 1e25 with a gate after the norm were 1.05e-6 off)."""
    edge_rows.check_large_means(evaluate, spec, jit=jit)
