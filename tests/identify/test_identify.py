"""normkit.identify: the NormSpec of a black-box norm, recovered by probing it."""

import math

import numpy as np
import pytest

from normkit import NormSpec, reference
from normkit.dtypes import is_half
from normkit.identify import Identification, identify_forward
from normkit.spec import CASTS, EPS_PLACEMENTS, KINDS

NOT_A_NORM = "does not behave like RMSNorm, partial RMSNorm, LayerNorm or DyT: "
# Without parameters: the affine fields, and the output dtype (the layer's own parameters' dtype
# is unknown); a forward probe never sees the backward.
WITHOUT_PARAMS = ("scale", "scale_offset", "bias", "cast", "offset_dtype", "output_dtype", "backward")


def reference_forward(spec, accepts_params):
    """The reference as a black box; parameters the spec lacks are ignored, as a bridge does."""

    def forward(x, scale, bias):
        if not accepts_params:
            assert scale is None and bias is None
        return reference.normalize(
            x, spec, scale if spec.scale else None, bias if spec.bias else None
        )

    return forward


def float32_forward(spec, *, variance="two_pass", promote=False):
    """``spec`` computed in float32 numpy, sharing no code with the reference.

    ``variance="moments"`` is Flax's E[x²] - E[x]²; ``promote`` returns float32 for half inputs
    (Flax with float32 parameters, or Hugging Face Llama with a float32 weight).
    """
    f32 = np.float32

    def forward(x, scale, bias):
        x32 = x.astype(f32)
        n = x.shape[1]
        if spec.kind == "layer":
            mean = np.mean(x32, axis=1, keepdims=True, dtype=f32)
            c = x32 - mean
            if variance == "moments":
                s = np.mean(x32 * x32, axis=1, keepdims=True, dtype=f32) - mean * mean
            else:
                s = np.mean(c * c, axis=1, keepdims=True, dtype=f32)
        else:
            k = max(1, int(n * spec.p)) if spec.kind == "partial_rms" else n
            c = x32
            s = np.mean(x32[:, :k] * x32[:, :k], axis=1, keepdims=True, dtype=f32)
        eps = f32(spec.eps)
        y = c / np.sqrt(s + eps) if spec.eps_placement == "inside" else c / (np.sqrt(s) + eps)
        if spec.cast == "before_scale" and is_half(x.dtype):
            y = y.astype(x.dtype).astype(f32)
        if spec.scale:
            w = np.full(n, spec.scale_init, f32) if scale is None else scale.astype(f32)
            y = y * (f32(spec.scale_offset) + w)
        if spec.bias and bias is not None:
            y = y + bias.astype(f32)
        return y if promote and is_half(x.dtype) else y.astype(x.dtype)

    return forward


def random_spec(seed):
    """Every kind, eps log-uniform in 1e-8 .. 1e-2, both placements and cast orders, offset 0/1."""
    rng = np.random.default_rng(seed)
    kind = KINDS[seed % 3]
    scale = bool(rng.random() < 0.85)
    return NormSpec(
        kind,
        eps=float(10 ** rng.uniform(-8, -2)),
        eps_placement=str(rng.choice(EPS_PLACEMENTS)),
        p=float(10 ** rng.uniform(-1.5, 0)) if kind == "partial_rms" else None,
        scale=scale,
        scale_offset=float(rng.choice([0.0, 1.0])) if scale else 0.0,
        bias=bool(rng.random() < 0.5),
        cast=str(rng.choice(CASTS)),
    )


def assert_structure(found: Identification, spec: NormSpec, n: int):
    """kind, k, eps within 10% and placement: what every probe recovers, with or without params."""
    expected_kind = "rms" if spec.kind == "partial_rms" and spec.stat_size(n) == n else spec.kind
    assert found.spec.kind == expected_kind, found.describe()
    assert found.spec.stat_size(n) == spec.stat_size(n), found.describe()
    assert found.spec.eps_placement == spec.eps_placement, found.describe()
    assert abs(found.spec.eps / spec.eps - 1) < 0.1, found.describe()


def assert_affine(found: Identification, spec: NormSpec, unseen: tuple[str, ...] = ()):
    """With parameters: scale, offset, bias and (when an affine step exists) the cast order;
    every field but ``unseen`` and the backward determined."""
    assert found.spec.scale == spec.scale, found.describe()
    assert found.spec.scale_offset == spec.scale_offset, found.describe()
    assert found.spec.bias == spec.bias, found.describe()
    assert found.spec.offset_dtype == spec.offset_dtype, found.describe()
    if spec.scale or spec.bias:
        assert found.spec.cast == spec.cast, found.describe()
        assert found.undetermined == (*unseen, "backward"), found.describe()
    else:
        assert found.undetermined == ("cast", *unseen, "backward"), found.describe()


@pytest.mark.parametrize("seed", range(48))
def test_recovers_random_reference_specs(seed):
    spec = random_spec(seed)
    n = (16, 64, 100)[(seed // 3) % 3]
    with_params = identify_forward(reference_forward(spec, True), n, accepts_params=True)
    assert_structure(with_params, spec, n)
    assert_affine(with_params, spec)

    without = identify_forward(reference_forward(spec, False), n, accepts_params=False)
    assert_structure(without, spec, n)
    assert without.undetermined == WITHOUT_PARAMS, without.describe()
    assert without.spec.scale_offset == 0.0 and without.spec.cast == "after_scale"


@pytest.mark.parametrize(
    "spec",
    [
        NormSpec("partial_rms", p=0.29, eps=1e-8, eps_placement="outside"),  # k = 28 at n = 100
        NormSpec("partial_rms", p=0.001, eps=1e-6),  # k = 1
        NormSpec("partial_rms", p=1.0, eps=1e-6),  # k = n: the same function as rms
        NormSpec("layer", eps=1e-2, eps_placement="outside", bias=False),
    ],
)
def test_edge_fractions_and_eps(spec):
    found = identify_forward(reference_forward(spec, True), 100, accepts_params=True)
    assert_structure(found, spec, 100)
    assert_affine(found, spec)


def test_p_is_reported_with_the_interval_that_gives_the_same_k():
    spec = NormSpec("partial_rms", p=0.0625, eps=1e-8, eps_placement="outside")
    found = identify_forward(reference_forward(spec, True), 100, accepts_params=True)
    assert found.spec.p == 0.06 and found.spec.stat_size(100) == 6
    assert any("every p in [0.06, 0.07) gives the same k" in note for note in found.notes)
    k1 = identify_forward(
        reference_forward(NormSpec("partial_rms", p=0.01), True), 64, accepts_params=True
    )
    assert k1.spec.stat_size(64) == 1
    assert any("every p in (0, 2/n)" in note for note in k1.notes)


@pytest.mark.parametrize("n", [300, 1000])
def test_large_rows_search_for_k(n):
    spec = NormSpec("partial_rms", p=0.37, eps=3e-7, scale_offset=1.0, cast="before_scale")
    found = identify_forward(reference_forward(spec, True), n, accepts_params=True)
    assert_structure(found, spec, n)
    assert_affine(found, spec)


FLOAT32_SPECS = [
    NormSpec("rms", eps=1e-8, eps_placement="outside"),
    NormSpec("rms", eps=1.1920929e-07),  # torch.nn.RMSNorm's float32 default
    NormSpec("partial_rms", p=0.0625, eps=1e-8, eps_placement="outside", bias=True),
    NormSpec("rms", eps=1e-6, scale_offset=1.0),  # Gemma
    NormSpec("rms", eps=1e-5, cast="before_scale"),  # Llama
    NormSpec("layer", eps=1e-5),  # torch LayerNorm
    NormSpec("layer", eps=1e-3, eps_placement="outside", cast="before_scale"),
    NormSpec("layer", eps=1e-8),
]


@pytest.mark.parametrize(
    "spec", FLOAT32_SPECS, ids=lambda s: f"{s.kind}-{s.eps:g}-{s.eps_placement}"
)
@pytest.mark.parametrize("n", [16, 100])
def test_recovers_float32_implementations(spec, n):
    found = identify_forward(float32_forward(spec), n, accepts_params=True)
    assert_structure(found, spec, n)
    assert_affine(found, spec)
    without = identify_forward(float32_forward(spec), n, accepts_params=False)
    assert_structure(without, spec, n)
    assert without.undetermined == WITHOUT_PARAMS


def test_flax_fast_variance_and_output_promotion():
    flax_layer = NormSpec("layer", eps=1e-6, variance="fast", output_dtype="promote")
    found = identify_forward(
        float32_forward(flax_layer, variance="moments", promote=True), 64, accepts_params=True
    )
    assert found.spec.replace(eps=1e-6) == flax_layer, found.describe()
    assert found.undetermined == ("backward",)
    assert any(
        note.startswith("variance fast (E[x^2] - E[x]^2)") and "square of the mean" in note
        for note in found.notes
    ), found.describe()
    assert any(
        "bfloat16 input: output dtype float32 (promotes: output_dtype promote)" in note
        for note in found.notes
    )
    two_pass = identify_forward(
        float32_forward(flax_layer, promote=True), 64, accepts_params=True
    )
    assert two_pass.spec.variance == "two_pass", two_pass.describe()
    llama = NormSpec("rms", eps=1e-6, cast="before_scale", output_dtype="promote")
    found = identify_forward(float32_forward(llama, promote=True), 64, accepts_params=True)
    assert found.spec == llama, found.describe()


def test_variance_does_not_show_in_half_precision_probes():
    flax_layer = NormSpec("layer", eps=1e-6, variance="fast")
    found = identify_forward(
        float32_forward(flax_layer, variance="moments"), 32, accepts_params=True,
        dtypes=("bfloat16",),
    )
    assert found.undetermined == ("variance", "backward"), found.describe()
    assert any("half-precision row's squares and sums are exact" in n for n in found.notes)


def held_in_input_dtype(spec):
    """The reference with the parameters held in the input's dtype (``module.to(dtype)``)."""

    def forward(x, scale, bias):
        cast = [None if p is None else p.astype(x.dtype) for p in (scale, bias)]
        return reference.normalize(x, spec, cast[0] if spec.scale else None,
                                   cast[1] if spec.bias else None)

    return forward


@pytest.mark.parametrize("offset_dtype", ["param", "float32"])
@pytest.mark.parametrize("cast", ["after_scale", "before_scale"])
def test_offset_dtype_shows_with_half_parameters(offset_dtype, cast):
    spec = NormSpec("rms", scale_offset=1.0, offset_dtype=offset_dtype, cast=cast)
    found = identify_forward(held_in_input_dtype(spec), 32, accepts_params=True)
    assert found.spec == spec, found.describe()
    assert found.undetermined == ("backward",)


DYT_SPECS = [
    NormSpec("dyt"),
    NormSpec("dyt", alpha_init=1.0, bias=False, cast="before_scale"),
    NormSpec("dyt", alpha_init=0.2, scale_offset=1.0),
]


@pytest.mark.parametrize("spec", DYT_SPECS, ids=repr)
def test_dyt_kind_and_alpha(spec):
    found = identify_forward(reference_forward(spec, True), 24, accepts_params=True)
    assert found.spec.kind == "dyt" and found.spec.eps is None, found.describe()
    assert abs(found.spec.alpha_init / spec.alpha_init - 1) < 1e-3, found.describe()
    assert found.spec.replace(alpha_init=spec.alpha_init) == spec, found.describe()
    assert found.undetermined == ("backward",)
    without = identify_forward(reference_forward(spec, False), 24, accepts_params=False)
    assert without.spec.kind == "dyt", without.describe()
    assert abs(without.spec.alpha_init / spec.alpha_init - 1) < 1e-3, without.describe()
    assert "scale" in without.undetermined


def test_residual_and_backward_are_not_observable_through_a_forward_probe():
    found = identify_forward(reference_forward(NormSpec(), True), 16, accepts_params=True)
    assert found.spec.residual is None and "backward" in found.undetermined
    assert any(note.startswith("residual: none; the probes call forward(x) -> y") for note in found.notes)
    assert any(note.startswith("backward: undetermined (the probes see the forward only") for note in found.notes)


def test_parameters_not_at_their_initial_values_without_params():
    """A trained layer: eps is still found, the bias shows in f(0), and w != 1 reveals the cast."""
    spec = NormSpec("layer", eps=1e-4, eps_placement="outside", cast="before_scale")
    rng = np.random.default_rng(5)
    w = rng.uniform(0.5, 2.0, 32)
    b = rng.normal(size=32)

    def trained(x, scale, bias):
        return reference.normalize(x, spec, w, b)

    found = identify_forward(trained, 32, accepts_params=False)
    assert_structure(found, spec, 32)
    assert found.spec.bias is True and found.spec.cast == "before_scale"
    assert found.undetermined == ("scale", "scale_offset", "offset_dtype", "output_dtype", "backward")
    assert any("not at their initial values" in note for note in found.notes)


@pytest.mark.parametrize("seed", range(6))
def test_bfloat16_only_probes(seed):
    """With only a half dtype the structure, the parameters and the cast still come out."""
    spec = random_spec(seed)
    found = identify_forward(
        reference_forward(spec, True), 64, accepts_params=True, dtypes=("bfloat16",)
    )
    assert_structure(found, spec, 64)
    assert_affine(found, spec, ("variance",) if spec.kind == "layer" else ())


def test_negligible_eps_and_no_half_dtype_are_reported_undetermined():
    spec = NormSpec("rms", eps=1e-30)
    found = identify_forward(
        reference_forward(spec, True), 16, accepts_params=True, dtypes=("float32",)
    )
    assert found.undetermined == (
        "eps", "eps_placement", "cast", "output_dtype", "backward"
    )
    assert found.spec.eps == NormSpec().eps
    assert any(note.startswith("eps: too small to change any probe") for note in found.notes)
    assert any(
        note == "cast, offset_dtype, output_dtype: no half-precision dtype was probed"
        for note in found.notes
    )


def test_describe_lists_spec_undetermined_and_notes():
    found = identify_forward(reference_forward(NormSpec(), False), 16, accepts_params=False)
    text = found.describe()
    assert text.splitlines()[0] == repr(found.spec)
    assert "undetermined: " + ", ".join(WITHOUT_PARAMS) in text
    assert "- eps 1e-06 (inside the sqrt)" in text


def statistic_from_the_end(x, scale, bias):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64[:, -4:] ** 2, axis=1, keepdims=True) + 1e-6)).astype(x.dtype)


def eps_growing_with_the_statistic(x, scale, bias):
    """1 / sqrt(s + 1e-4 sqrt(s)): scale-invariant for large rows, but no fixed eps fits."""
    x64 = x.astype(np.float64)
    s = np.mean(x64**2, axis=1, keepdims=True)
    return (x64 / np.sqrt(s + 1e-4 * np.sqrt(s) + 1e-30)).astype(x.dtype)


def keras_rms_scaling(x, scale, bias):
    """keras LayerNormalization(rms_scaling=True): the variance is centered, the output is not."""
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.var(x64, axis=1, keepdims=True) + 1e-3)).astype(x.dtype)


def test_tanh_is_dyt_with_alpha_1():
    def tanh(x, scale, bias):
        return np.tanh(x.astype(np.float32)).astype(x.dtype)

    found = identify_forward(tanh, 16, accepts_params=False)
    assert found.spec.kind == "dyt" and abs(found.spec.alpha_init - 1) < 1e-4, found.describe()


def max_scaling(x, scale, bias):
    return x / (np.abs(x).max(axis=1, keepdims=True) + 1e-30)


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        pytest.param(lambda x, s, b: x, "it acts elementwise.*not DyT", id="identity"),
        pytest.param(lambda x, s, b: x * x * x, "it acts elementwise.*not DyT", id="cube"),
        pytest.param(
            lambda x, s, b: x - x.mean(axis=1, keepdims=True), "it is not scale-invariant",
            id="centering",
        ),
        pytest.param(lambda x, s, b: np.sign(x), "it acts elementwise.*not DyT", id="sign"),
        pytest.param(lambda x, s, b: np.arctan(x), "no fixed alpha fits", id="arctan"),
        pytest.param(lambda x, s, b: 0 * x, "its output does not depend on the input", id="zero"),
        pytest.param(max_scaling, "the closest spec it matches", id="max-scaling"),
        pytest.param(statistic_from_the_end, "not a leading block", id="trailing-statistic"),
        pytest.param(keras_rms_scaling, "the closest spec it matches", id="keras-rms-scaling"),
        pytest.param(eps_growing_with_the_statistic, "no fixed eps explains", id="eps-not-fixed"),
        pytest.param(lambda x, s, b: x[:, :-1], "it returned shape", id="shape"),
    ],
)
def test_a_function_that_is_not_a_norm_is_rejected(forward, reason):
    with pytest.raises(ValueError, match=NOT_A_NORM + ".*" + reason):
        identify_forward(forward, 16, accepts_params=False)


def test_a_bias_that_is_not_added_is_rejected():
    spec = NormSpec("layer")

    def doubled_bias(x, scale, bias):
        return reference.normalize(x, spec, scale, None if bias is None else 2 * bias)

    with pytest.raises(ValueError, match=NOT_A_NORM + "the bias passed is neither added"):
        identify_forward(doubled_bias, 16, accepts_params=True)


def test_invalid_arguments():
    forward = reference_forward(NormSpec(), True)
    with pytest.raises(ValueError, match="at least 2 elements, got n=1"):
        identify_forward(forward, 1, accepts_params=True)
    with pytest.raises(ValueError, match="at least one dtype"):
        identify_forward(forward, 16, accepts_params=True, dtypes=())
    with pytest.raises(TypeError, match="a probed dtype has dtype int32"):
        identify_forward(forward, 16, accepts_params=True, dtypes=("int32",))


def test_large_n_is_fast_enough():
    n = 16384
    spec = NormSpec("partial_rms", p=0.0625, eps=1e-8, eps_placement="outside")
    found = identify_forward(
        reference_forward(spec, True), n, accepts_params=True, dtypes=("float32", "bfloat16")
    )
    assert_structure(found, spec, n)
    assert math.isclose(found.spec.p, 0.0625)
