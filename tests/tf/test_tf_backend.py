"""Reference checks of normkit.tf that hold on every Keras backend.

pytest runs them on the TensorFlow backend; tests/tf/test_tf_keras.py runs this file again with
KERAS_BACKEND=jax and =torch, each in its own process.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

# Keras imports its backend's framework (TensorFlow unless KERAS_BACKEND names another); where
# that is missing, the module skips with the missing module's name.
keras = pytest.importorskip("keras")

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.conformance.targets_keras import devices, evaluate, keras_backend  # noqa: E402
from normkit.tf import LayerNorm, PartialRMSNorm, RMSNorm, from_spec  # noqa: E402

# Keras' TensorFlow backend converts tensors with np.array(x), which numpy 2 flags; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")

DTYPES = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
KIND_ARGS = {"rms": {}, "partial_rms": {"p": 0.3}, "layer": {}}
# (shape, axis): the last axis, an inner axis, and two axes (non-trailing for rank 4).
LAYOUTS = [((3, 10), -1), ((2, 5, 3), 1), ((2, 3, 4, 2), (1, 2))]
WEIGHTS = [
    {"scale": True, "scale_offset": 0.0},
    {"scale": True, "scale_offset": 1.0},
    {"scale": False},
]


def check(
    spec: NormSpec,
    shape: tuple[int, ...],
    dtype: str,
    *,
    seed: int = 0,
    random_weights: bool = True,
    x: np.ndarray | None = None,
    **variant: object,
) -> None:
    """evaluate() against the reference, forward and gradients, under normkit.tolerances."""
    rng = np.random.default_rng(seed)
    policy = variant.get("policy")
    in_dtype = DTYPES[dtype]
    if x is None:
        x = rng.standard_normal(shape).astype(in_dtype)
    # Under a policy the layer casts its input to the compute dtype; the reference sees that
    # input. Without one, evaluate picks the policy that keeps x's dtype.
    seen = x.astype(DTYPES[keras.DTypePolicy(policy).compute_dtype]) if policy else x
    dy = rng.standard_normal(shape).astype(seen.dtype)
    param_shape = spec.param_shape(shape)
    w = b = None
    if random_weights and spec.scale:
        w = (spec.scale_init + 0.5 * rng.standard_normal(param_shape)).astype(np.float32)
    if random_weights and spec.bias:
        b = rng.standard_normal(param_shape).astype(np.float32)
    y, dx, dw, db = evaluate(spec, x, dy, w, b, **variant)
    what = f"{spec} {dtype} {shape} {variant}"
    assert y.dtype == seen.dtype, what
    assert dx.dtype == x.dtype, what
    magnitude = None  # before_scale rounds y_hat * g, not y: the policy's ulps are at its size
    if spec.cast == "before_scale" and seen.dtype in (DTYPES["float16"], DTYPES["bfloat16"]):
        magnitude = reference.scaled_magnitude(seen, spec, w)
    tolerances.assert_close(
        y, reference.normalize(seen, spec, w, b), quantity="forward", cast=spec.cast, what=what,
        magnitude=magnitude,
    )
    rdx, rdw, rdb = reference.normalize_vjp(seen, dy, spec, w, b)
    # dx is rounded to the dtype the layer computed from (the gradient of its input cast), then
    # to x's: judge it in the coarser of the two.
    coarser = min((x.dtype, seen.dtype), key=lambda d: ml_dtypes.finfo(d).nmant)
    tolerances.assert_close(dx, rdx, coarser, quantity="grad", what=f"dx {what}")
    assert (dw is None) == (rdw is None) and (db is None) == (rdb is None), what
    if dw is not None:
        tolerances.assert_close(dw, rdw, quantity="grad", what=f"dscale {what}")
    if db is not None:
        tolerances.assert_close(db, rdb, quantity="grad", what=f"dbias {what}")


def _grid() -> list[tuple[str, str, str, str, dict[str, object], bool, tuple, object]]:
    cases = []
    for kind, dtype, placement, weights, bias, (shape, axis) in itertools.product(
        KIND_ARGS, DTYPES, ("inside", "outside"), WEIGHTS, (False, True), LAYOUTS
    ):
        for cast in ("after_scale", "before_scale") if dtype in ("float16", "bfloat16") else ("after_scale",):
            cases.append((kind, dtype, placement, cast, weights, bias, shape, axis))
    return cases


@pytest.mark.parametrize("kind,dtype,placement,cast,weights,bias,shape,axis", _grid())
def test_every_option_matches_reference(kind, dtype, placement, cast, weights, bias, shape, axis):
    spec = NormSpec(kind, eps_placement=placement, cast=cast, bias=bias, axis=axis, **weights, **KIND_ARGS[kind])
    check(spec, shape, dtype)


JIT_SPECS = [
    NormSpec("rms", scale_offset=1.0, axis=(1, 2)),
    NormSpec("partial_rms", p=0.25, eps_placement="outside", bias=True, cast="before_scale"),
    NormSpec("layer", axis=1, cast="before_scale"),
]


@pytest.mark.skipif(keras_backend() == "torch", reason="the torch Keras backend has no jit")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", JIT_SPECS, ids=lambda s: s.kind)
def test_jit_matches_reference(spec, dtype):
    """tf.function(jit_compile=True) on TensorFlow, jax.jit on JAX."""
    check(spec, (2, 6, 4, 8), dtype, jit=True)


@pytest.mark.skipif(keras_backend() == "torch", reason="the torch Keras backend has no jit")
@pytest.mark.parametrize("kind", list(KIND_ARGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_rows_match_reference(kind, dtype):
    spec = NormSpec(kind, bias=True, **KIND_ARGS[kind])
    check(spec, (16, 4096), dtype)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", JIT_SPECS, ids=lambda s: s.kind)
def test_mixed_policy_matches_reference_on_the_cast_input(spec, in_dtype, policy):
    """x is cast to the compute dtype, statistics in float32, output in the compute dtype."""
    check(spec, (3, 5, 4, 6), in_dtype, policy=policy)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_policy_keeps_float32_variables(policy):
    layer = LayerNorm(dtype=policy)
    y = layer(np.ones((2, 8), np.float32))
    assert [v.dtype for v in layer.weights] == ["float32", "float32"]
    assert keras.backend.standardize_dtype(y.dtype) == keras.DTypePolicy(policy).compute_dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_float32_policy_casts_the_input_as_keras_does(dtype):
    """Keras' autocast: under the float32 policy a half or float64 input is cast to float32 and
    the output is float32, as keras.layers.RMSNormalization and LayerNormalization return; the
    forward and the gradients are the reference's on the float32 input (dx in x's dtype)."""
    x = np.random.default_rng(4).standard_normal((3, 16)).astype(DTYPES[dtype])
    seen = x.astype(np.float32)
    pairs = ((RMSNorm(), keras.layers.RMSNormalization()),
             (LayerNorm(), keras.layers.LayerNormalization()))
    for ours, theirs in pairs:
        assert ours.compute_dtype == "float32"
        y = ours(x)
        assert keras.backend.standardize_dtype(y.dtype) == "float32"
        assert keras.backend.standardize_dtype(theirs(x).dtype) == "float32"
        y = keras.ops.convert_to_numpy(y)
        tolerances.assert_close(y, reference.normalize(seen, ours.spec))
        # Keras' LayerNormalization computes the statistics of a half input in its dtype, so
        # Keras' layers are compared on the float32 input that normkit's layers compute from.
        np.testing.assert_allclose(y, keras.ops.convert_to_numpy(theirs(seen)), atol=2e-6)
        check(ours.spec, (4, 16), dtype, policy="float32")


@pytest.mark.parametrize(
    "p,n,k", [(0.29, 100, 28), (0.0625, 64, 4), (0.001, 16, 1), (1.0, 12, 12), (0.5, 7, 3)]
)
def test_partial_statistic_reads_the_first_k(p, n, k):
    spec = NormSpec("partial_rms", p=p)
    assert spec.stat_size(n) == k
    check(spec, (3, n), "float32")
    # Only the first k elements may move the statistic: changing the rest scales nothing.
    x = np.random.default_rng(1).standard_normal((1, n)).astype(np.float32)
    x2 = x.copy()
    x2[0, k:] *= 3.0
    layer = PartialRMSNorm(p)
    y, y2 = (keras.ops.convert_to_numpy(layer(v)) for v in (x, x2))
    np.testing.assert_array_equal(y[0, :k], y2[0, :k])


@pytest.mark.parametrize("kind", list(KIND_ARGS))
def test_zero_rows_with_eps_outside_have_the_reference_gradient(kind):
    """At s = 0 sqrt is not differentiable; the reference's limit is finite, so is ours."""
    spec = NormSpec(kind, eps_placement="outside", eps=1e-3, **KIND_ARGS[kind])
    x = np.random.default_rng(2).standard_normal((3, 10)).astype(np.float32)
    x[1] = 0.0
    x[2] = 0.5 if kind == "layer" else 0.0
    check(spec, (3, 10), "float32", x=x)


# Rows whose output has one direction left: n = 1 for the RMS kinds, n = 2 for LayerNorm.
DEGENERATE_N = {"rms": 1, "partial_rms": 1, "layer": 2}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", list(KIND_ARGS))
def test_degenerate_rows_have_the_reference_input_gradient(kind, placement, offset, dtype, jit):
    """n = 1 (RMS kinds), n = 2 (layer): dx is of order eps (d eps r^3 inside, d eps r^2
    outside), which autodiff of c * r would form as a difference of nearly equal terms."""
    if jit and keras_backend() == "torch":
        pytest.skip("the torch Keras backend has no jit")
    spec = NormSpec(kind, eps_placement=placement, scale_offset=offset, **KIND_ARGS[kind])
    # A few standard normal rows, as in the conformance matrix: max|dx| is that of the row of
    # smallest |c|, and with few rows it is not far above the others' (more rows would hide
    # their errors below the bound).
    check(spec, (6, DEGENERATE_N[kind]), dtype, jit=jit, seed=int(jit))


DEGENERATE_VALUES = {
    # each row alone: 0, near sqrt(eps) (where eps r^3 peaks), small, large
    1: [[0.0], [1e-3], [-7e-4], [2e-2], [-30.0]],
    # equal, close (x0 - x1 exact in float32 but not x0 - mean(x)), far, one zero
    2: [[0.0, 0.0], [1.5, 1.5], [1.5, 1.5 + 2e-3], [-2.0, -2.0 + 3e-5], [0.3, -0.7], [0.0, 1e-3]],
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", list(KIND_ARGS))
def test_degenerate_rows_at_special_values_have_the_reference_gradient(kind, placement, dtype):
    # No bias: alone in its output, a row must not have y_hat * g cancelled by b.
    spec = NormSpec(kind, eps_placement=placement, scale_offset=1.0, bias=False, **KIND_ARGS[kind])
    for i, row in enumerate(DEGENERATE_VALUES[DEGENERATE_N[kind]]):
        x = np.array([row], np.float64).astype(DTYPES[dtype])
        check(spec, x.shape, dtype, x=x, seed=i)


@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("kind", list(KIND_ARGS))
def test_float64_rows_beyond_float32s_range_match_the_reference(kind, placement):
    """float64 rows of 1e-100 and 1e100 (their squares outside float32's range), a zero row,
    and rows whose statistic reads one element (n = 1): the bounds that judge a row are
    float64's on every backend (on Keras' torch backend a Python float, and ops.maximum, would
    meet them in float32: NaN rows)."""
    spec = NormSpec(kind, eps_placement=placement, **KIND_ARGS[kind])
    scales = np.array([1e-100, 1e100, 0.0, 1.0])[:, None]
    x = np.random.default_rng(7).standard_normal((4, 10)) * scales
    check(spec, x.shape, "float64", x=x)
    check(spec, (3, 1), "float64", x=np.array([[0.5], [1.5], [-2.0]]))


@pytest.mark.parametrize("kind", list(KIND_ARGS))
@pytest.mark.parametrize("shape,axis", [((4, 2, 3), 1), ((3, 2, 1, 2), (1, 2)), ((2, 1, 5, 2), (1, 3))])
def test_degenerate_rows_on_inner_and_several_axes(kind, shape, axis):
    """The normalized elements of size n = 1 (RMS) or 2 (layer) over non-trailing axes."""
    if kind != "layer":  # one element: size 1 on every normalized axis
        axes = NormSpec(axis=axis).resolve_axes(len(shape))
        shape = tuple(1 if a in axes else d for a, d in enumerate(shape))
    spec = NormSpec(kind, axis=axis, bias=True, **KIND_ARGS[kind])
    assert np.prod(spec.param_shape(shape)) == DEGENERATE_N[kind]
    check(spec, shape, "float32")


@settings(max_examples=10, deadline=None)
@given(
    kind=st.sampled_from(list(KIND_ARGS)),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple),
    data=st.data(),
    p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_axes_and_p(kind, shape, data, p, seed):
    rank = len(shape)
    axis = data.draw(
        st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank, unique_by=lambda a: a % rank)
    )
    spec = NormSpec(kind, p=p if kind == "partial_rms" else None, axis=tuple(axis), bias=True)
    # The degenerate rows (n = 1, and n = 2 for layer) have their own tests above. Here a few
    # elements are left out: in a tiny output a bias that cancels y_hat * g can leave max|y| below
    # the float32 rounding of those terms, a limit of the forward bound rather than of the layer.
    assume(np.prod(spec.param_shape(shape)) >= 4)
    check(spec, shape, "float32", seed=seed)


def test_initial_weights_follow_the_spec():
    for spec in (NormSpec(), NormSpec(scale_offset=1.0, bias=True), NormSpec("layer", axis=(0, 2))):
        layer = from_spec(spec)
        layer.build((3, 4, 5))
        expected = [np.full(spec.param_shape((3, 4, 5)), spec.scale_init)]
        if spec.bias:
            expected.append(np.zeros(spec.param_shape((3, 4, 5))))
        assert [w.name for w in layer.weights] == ["scale", "bias"][: len(expected)]
        got = layer.get_weights()
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_array_equal(g, e)
        # The initial weights compute the spec with its default parameters.
        check(spec, (3, 4, 5), "float32", random_weights=False)


def test_devices_lists_cpu_first():
    found = devices()
    assert found[0] == "cpu"
    assert all(d.startswith("cuda:") for d in found[1:])


@pytest.mark.gpu
def test_gpu_matches_reference():
    if len(devices()) < 2:
        pytest.skip(f"the {keras_backend()} backend sees no GPU")
    for spec in JIT_SPECS:
        for dtype in ("float32", "bfloat16"):
            check(spec, (4, 8, 256), dtype, device="cuda:0")


def test_integer_input_raises_type_error():
    with pytest.raises(TypeError, match=r"has dtype int32; RMSNorm needs a floating input"):
        RMSNorm()(np.ones((2, 4), np.int32))


def test_axis_out_of_range_names_axis_and_rank():
    with pytest.raises(ValueError, match=r"input of shape \(2, 4\).*axis 2 is out of range for an input of rank 2"):
        LayerNorm(axis=2)(np.ones((2, 4), np.float32))


def test_a_later_call_with_other_sizes_names_axis_and_sizes():
    layer = RMSNorm(axis=(1, 2))
    layer(np.ones((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match=r"axis 2 of the input \(shape \(2, 3, 5\)\) has size 5, but the layer was built for size 4"):
        layer(np.ones((2, 3, 5), np.float32))


def test_evaluate_rejects_bad_requests():
    spec = NormSpec()
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"unknown variant options \['fast'\]"):
        evaluate(spec, x, x, fast=True)
    with pytest.raises(ValueError, match=r"device 'tpu:7' is not one \w+ sees"):
        evaluate(spec, x, x, device="tpu:7")
    with pytest.raises(ValueError, match=r"bias was given but the spec has bias=False"):
        evaluate(spec, x, x, bias=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"scale has shape \(3,\), expected \(4,\)"):
        evaluate(spec, x, x, scale=np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"dy has shape \(4,\), expected the shape of x, \(2, 4\)"):
        evaluate(spec, x, x[0])


@pytest.mark.skipif(keras_backend() != "torch", reason="the torch backend's own limitation")
def test_torch_backend_refuses_jit():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"the torch Keras backend has no jit variant"):
        evaluate(NormSpec(), x, x, jit=True)


@pytest.mark.skipif(keras_backend() != "jax", reason="JAX's autodiff outside jit")
@pytest.mark.parametrize("spec", JIT_SPECS, ids=lambda s: s.kind)
def test_jax_vjp_of_an_eager_call_compiles_nothing_the_second_time(spec):
    """Under ``jax.vjp`` without ``jit`` the forward's values are known: its rows are judged on
    the host, not by a ``cond``, which JAX would compile anew on each call (0.9 s against 10 ms
    for a LayerNorm). The backward, traced on each call, branches through the same functions
    each time (an RMSNorm's backward compiled a ``cond`` per call: 70 ms against 1 ms)."""
    import jax
    from jax import monitoring

    layer = from_spec(spec)
    x, dy = np.random.default_rng(0).standard_normal((2, 2, 6, 4, 8)).astype(np.float32)
    layer(x)
    compiles: dict[str, list[float]] = {"forward": [], "backward": []}
    now = "forward"

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[now].append(duration)

    def call(v):
        y, _ = layer.stateless_call(layer.trainable_variables, layer.non_trainable_variables, v)
        return y

    jax.vjp(call, x)[1](dy)  # eager primitives compile once per shape
    monitoring.register_event_duration_secs_listener(listen)
    try:
        y, pullback = jax.vjp(call, x)
        now = "backward"
        (dx,) = pullback(dy)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert compiles == {"forward": [], "backward": []}, f"compilations in the second call: {compiles}"
    params = [np.asarray(w) for w in layer.get_weights()]
    scale, bias = params[0] if spec.scale else None, params[-1] if spec.bias else None
    tolerances.assert_close(np.asarray(y), reference.normalize(x, spec, scale, bias), quantity="forward")
    grads = reference.normalize_vjp(x, dy, spec, scale, bias)
    tolerances.assert_close(np.asarray(dx), grads.dx, quantity="grad")


@pytest.mark.parametrize("spec", [
    NormSpec("rms", bias=True), NormSpec("rms", scale=False, bias=True), NormSpec("rms", scale=False),
], ids=["scale-bias", "bias-only", "neither"])
def test_overflowing_cotangent_rows_get_the_reference_gradient_whatever_the_weights(spec):
    """A row whose ``sum(dy x)`` overflows (|x| 1e9, |dy| 1e29) takes the patched gradient of
    Keras' RMSNorm order, formed from ``dy`` times the scale where there is one: a bias is
    not a scale (on Keras' JAX backend, where the backward is traced on every call, the patch
    once multiplied by the bias)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 16)) * np.array([1e9, 1.0, 1e9])[:, None]).astype(np.float32)
    dy = (rng.standard_normal(x.shape) * np.array([1e29, 1.0, 1.0])[:, None]).astype(np.float32)
    scale = np.linspace(0.5, 1.5, 16).astype(np.float32) if spec.scale else None
    bias = np.linspace(-2.0, 3.0, 16).astype(np.float32) if spec.bias else None
    y, dx, *_ = evaluate(spec, x, dy, scale, bias)
    grads = reference.normalize_vjp(x, dy, spec, scale, bias)
    tolerances.assert_close(np.asarray(y), reference.normalize(x, spec, scale, bias), quantity="forward")
    tolerances.assert_close(np.asarray(dx), grads.dx, quantity="grad")


def _jitted_programs(layer, x, dy_argument=False):
    """The programs XLA compiles for ``layer``'s forward and forward+backward under ``jax.jit``,
    the layer called statelessly as Keras' JAX trainer calls it; the backward's cotangent ones,
    or with ``dy_argument`` an argument (no constant XLA might fold)."""
    import jax
    import jax.numpy as jnp

    layer.build(x.shape)
    weights = [v.value for v in layer.trainable_variables]
    frozen = [v.value for v in layer.non_trainable_variables]

    def forward(weights, x):
        return layer.stateless_call(weights, frozen, x)[0]

    def forward_backward(weights, x, dy):
        y, pullback = jax.vjp(forward, weights, x)
        return y, pullback(dy if dy_argument else jnp.ones_like(y))

    return (jax.jit(forward).lower(weights, x).compile().as_text(),
            jax.jit(forward_backward).lower(weights, x, x).compile().as_text())


@pytest.mark.skipif(keras_backend() != "jax", reason="compiles with jax.jit")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ours, theirs", [
    (RMSNorm, "RMSNormalization"), (LayerNorm, "LayerNormalization"),
], ids=["rms", "layer"])
def test_jax_jit_makes_no_more_passes_over_x_than_kerass_layer(ours, theirs, dtype):
    """A structural guard that times nothing: under ``jax.jit`` (as Keras' JAX trainer runs a
    model) the compiled forward makes no more passes over x-sized arrays than Keras' layer, and
    the forward+backward no more (RMSNorm: one more, the plain branch's output of what the
    backward reads). The Keras-order RMSNorm of eager calls differentiated its branch in place
    there: 11 passes against Keras' 8 in bfloat16 (a fifth of Keras' speed)."""
    import jax.numpy as jnp
    import keras

    from tests.helpers.hlo import passes

    x = jnp.ones((64, 512), dtype)
    policy = {"float32": "float32", "bfloat16": "mixed_bfloat16"}[dtype]
    counts = [
        [passes(program, x.size) for program in _jitted_programs(layer, x)]
        for layer in (ours(epsilon=1e-6, dtype=policy),
                      getattr(keras.layers, theirs)(epsilon=1e-6, dtype=policy))
    ]
    (mine_forward, mine_both), (keras_forward, keras_both) = counts
    assert mine_forward <= keras_forward, counts
    assert mine_both <= keras_both + (1 if ours is RMSNorm else 0), counts


@pytest.mark.skipif(keras_backend() != "jax", reason="compiles with jax.jit")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("make", [
    lambda policy: RMSNorm(epsilon=1e-6, dtype=policy),
    lambda policy: RMSNorm(epsilon=1e-6, eps_placement="outside", dtype=policy),
    lambda policy: RMSNorm(epsilon=1e-6, bias=True, dtype=policy),
    lambda policy: RMSNorm(epsilon=1e-6, scale_offset=1.0, dtype=policy),
    lambda policy: PartialRMSNorm(p=0.25, dtype=policy),
    lambda policy: LayerNorm(epsilon=1e-6, dtype=policy),
    lambda policy: LayerNorm(epsilon=1e-6, eps_placement="outside", dtype=policy),
], ids=["rms", "rms-eps-outside", "rms-bias", "rms-gemma-offset", "partial", "layer",
        "layer-eps-outside"])
def test_jax_jit_on_a_cpu_writes_no_array_of_xs_size_but_y_and_dx(make, dtype):
    """Under ``jax.jit`` on XLA's CPU backend the forward writes ``y`` alone and the
    forward+backward ``y`` and ``dx`` alone (a cotangent given as an argument): each reduction
    reads copies of its own of x, dy, the scale and the row statistics (`normkit.tf._programs.separately`). Before,
    the backward wrote two (float32) to four (bfloat16) more (dy's and a half x's float32
    conversions, y_hat, r broadcast to x's shape) and LayerNorm's bfloat16 forward one (x's
    conversion, read by both statistics): 1.4-2.7x slower at 32M elements."""
    import jax
    import jax.numpy as jnp

    from tests.helpers.hlo import writes

    if jax.default_backend() != "cpu":
        pytest.skip("the copies are for XLA's CPU backend, which writes out what fusions share")
    x = jnp.ones((64, 512), dtype)
    layer = make({"float32": "float32", "bfloat16": "mixed_bfloat16"}[dtype])
    forward, both = _jitted_programs(layer, x, dy_argument=True)
    assert writes(forward, x.size) == 1
    assert writes(both, x.size) == 2


@pytest.mark.skipif(keras_backend() != "jax", reason="JAX's x64 switch")
def test_jax_float64_is_computed_in_float64_with_x64_off():
    import jax

    enabled = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        rng = np.random.default_rng(0)
        x, dy = rng.standard_normal((2, 2, 5))
        spec = NormSpec("layer", eps=1e-5)
        y, dx, dscale, dbias = evaluate(spec, x, dy, jit=True)
    finally:
        jax.config.update("jax_enable_x64", enabled)
    grads = reference.normalize_vjp(x, dy, spec)
    assert y.dtype == dx.dtype == np.float64
    tolerances.assert_close(y, reference.normalize(x, spec), quantity="forward")
    tolerances.assert_close(dx, grads.dx, quantity="grad")
    tolerances.assert_close(dscale, grads.dscale, quantity="grad")


@pytest.mark.skipif(keras_backend() != "torch", reason="a Keras backend the benchmark measures")
def test_bench_refuses_keras_backends_it_does_not_measure():
    from normkit.bench import tf as bench
    from normkit.bench.core import run

    with pytest.raises(
        RuntimeError, match=r"measures Keras' backends \['tensorflow', 'jax'\]; KERAS_BACKEND is 'torch'"
    ):
        run(bench, quick=True)
