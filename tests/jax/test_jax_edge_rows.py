"""normkit.jax's rows at the edges keep to themselves, as the reference's do (tests/helpers/
edge_rows.py): the gate's SiLU below z = -88.7, and the rows beside a rescaled one and the NaN
in a partial RMS row's tail that broke normkit.tf (issue 48), held here too."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from normkit import NormSpec  # noqa: E402
from normkit.conformance.targets_jax import devices, evaluate  # noqa: E402
from normkit.jax import pallas  # noqa: E402
from tests.helpers import edge_rows  # noqa: E402

jits = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@jits
@pytest.mark.parametrize("dtype", list(edge_rows.DTYPES))
@pytest.mark.parametrize("gate", ["after", "before"])
def test_the_gates_silu_below_minus_88_is_not_zero(gate, dtype, jit):
    """Issue 48, defect 5: ``jax.nn.silu(-89)`` is 0 (1 / (1 + e^89) is), the reference's
    about 1e-37; dgate too, whose derivative is formed with the value (XLA's CPU code flushes
    the subnormal products autodiff would form)."""
    edge_rows.check_far_gate(evaluate, gate, dtype, api="functional", jit=jit)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_the_modules_gate_below_minus_88_is_not_zero(api):
    edge_rows.check_far_gate(evaluate, "after", "float32", api=api, jit=True)


@pytest.mark.parametrize("spec", edge_rows.NEIGHBOUR_SPECS, ids=edge_rows.spec_id)
def test_a_rescaled_row_leaves_its_neighbours_gradients_alone(spec):
    edge_rows.check_neighbours(evaluate, spec, "float32", api="functional", jit=True)


@pytest.mark.parametrize("spec", edge_rows.NAN_TAIL_SPECS, ids=edge_rows.spec_id)
def test_a_nan_in_a_partial_rows_tail_stays_out_of_the_rest_of_the_tail(spec):
    edge_rows.check_nan_tail(evaluate, spec, "float32", api="functional", jit=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["after", "before"])
def test_the_gates_silu_below_minus_88_is_not_zero_on_a_gpu(gate):
    if "cuda:0" not in devices():
        pytest.skip("JAX sees no GPU")
    edge_rows.check_far_gate(evaluate, gate, "float32", api="functional", jit=True,
                             device="cuda:0")


FAST_SPECS = [NormSpec("layer", variance="fast", bias=True),
              NormSpec("layer", variance="fast", eps=1e-5, eps_placement="outside")]


@jits
@pytest.mark.parametrize("spec", FAST_SPECS, ids=["inside", "outside"])
@pytest.mark.parametrize("rows", ["overflowing_squares", "large_mean"])
def test_the_fast_variance_rounds_as_the_references_does(spec, rows, jit):
    """The XLA program's exactly rounded fast moments gave NaN on rows whose squares overflow
    (``inf - inf`` in the pair sums), where the reference's ``v`` is infinite (``y = b``), and on
    rows whose squares' sum alone overflows, where the reference's ``m2`` is finite."""
    edge_rows.check_fast_rows(evaluate, spec, rows, api="functional", jit=jit)


@pytest.mark.parametrize("spec", FAST_SPECS, ids=["inside", "outside"])
@pytest.mark.parametrize("rows", ["overflowing_squares", "large_mean"])
def test_the_fast_variance_rounds_as_the_references_does_in_the_kernels(spec, rows):
    with pallas.interpreted():
        edge_rows.check_fast_rows(evaluate, spec, rows, api="functional", jit=True,
                                  implementation="pallas")


@jits
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dyts_slope_is_kept_where_tanh_rounds_to_one(dtype, jit):
    """DyT's ``1 - tanh(u)^2`` is 0 in float32 from |u| = 9 on: dx was 0 on rows of 30 + N(0, 1)
    with alpha 0.5, the reference's about 1e-12; its slope is now sech(u)^2 from e^-2|u|."""
    edge_rows.check_far_dyt(evaluate, dtype, api="functional", jit=jit)


@pytest.mark.parametrize("backward", ["exact", "autograd"])
def test_dyts_slope_through_the_modules_and_jax_autodiff(backward):
    """The modules' DyT, and ``backward="autograd"``, which JAX differentiates (jnp.tanh's
    derivative is ``1 - tanh(u)^2``)."""
    from normkit.conformance import targets_jax

    def evaluate_spec(spec, *args, **kwargs):
        return targets_jax.evaluate(spec.replace(backward=backward), *args, **kwargs)

    edge_rows.check_far_dyt(evaluate_spec, "float32", api="linen", jit=True)


def test_dyts_slope_in_the_kernels():
    with pallas.interpreted():
        edge_rows.check_far_dyt(evaluate, "float32", api="functional", jit=True,
                                implementation="pallas")


@jits
@pytest.mark.parametrize("spec", edge_rows.LARGE_MEAN_SPECS, ids=str)
def test_rows_of_a_large_mean_at_every_scale(spec, jit):
    """Rows s (10 + N(0, 1)), each row and group on its own: those below 1e-19 have squares
    (mean^2 and s) that flush to 0, so ``mean^2 > s`` did not send them to the correction pass
    (y 1.2-1.7e-6 of their max|y| off); and the rescaling's 1 / max|x| rounded every value
    before the centering (ten times that relative to the centered values)."""
    edge_rows.check_large_means(evaluate, spec, api="functional", jit=jit)


@pytest.mark.parametrize("spec", edge_rows.LARGE_MEAN_SPECS, ids=str)
def test_rows_of_a_large_mean_at_every_scale_in_the_kernels(spec):
    with pallas.interpreted():
        edge_rows.check_large_means(evaluate, spec, api="functional", jit=True,
                                    implementation="pallas")
