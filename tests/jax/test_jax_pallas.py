"""normkit.jax's Pallas kernels (`normkit.jax.pallas`) in Pallas' interpreter, against the
reference: every option of the spec once and each pair that interacts, forward and backward,
and the edge rows (squares that overflow or underflow float32, large means, tiny statistics with
eps outside, large cotangents, NaN and infinity confined to their row).

Each case runs `normkit.jax.functional` with ``implementation="pallas"`` inside
`normkit.jax.pallas.interpreted` (the kernels on the CPU), forward and backward as one jitted
program, through normkit.jax's conformance hook (`normkit.conformance.targets_jax`), checked by
`normkit.conformance.compare` (the tolerance policy) and ``h`` bit for bit. The shapes are small
(the interpreter runs each program of the grid in turn); the rows are not powers of two, so
the kernels' masks are exercised, and there are more rows than one tile holds.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

from normkit import NormSpec, dtypes
from normkit.conformance import compare as conformance
from normkit.conformance.compare import Inputs

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

from normkit.conformance import targets_jax  # noqa: E402
from normkit.jax import functional, pallas  # noqa: E402

F32, F16, BF16 = dtypes.float32, dtypes.float16, dtypes.bfloat16


def check(spec: NormSpec, inputs: Inputs, device: str = "cpu") -> dict[str, np.ndarray | None]:
    """The kernels' outputs for ``inputs`` within the tolerance of every quantity, ``h`` bit
    for bit; returned by name. On the CPU in Pallas' interpreter, on a GPU compiled."""
    x, dy, scale, bias, residual, dh, alpha, gate = inputs
    with pallas.interpreted() if device == "cpu" else contextlib.nullcontext():
        outputs = targets_jax.evaluate(spec, x, dy, scale, bias, residual=residual, dh=dh,
                                       alpha=alpha, gate=gate, api="functional",
                                       implementation="pallas", device=device)
    problems, _ = conformance.compare(spec, inputs, outputs)
    assert not problems, f"{spec}: " + "; ".join(problems)
    got = dict(zip(conformance.quantities(spec), outputs, strict=True))
    if "h" in got:
        np.testing.assert_array_equal(got["h"], conformance.expected(spec, inputs)["h"])
    return got


def _normal(seed: int, shape: tuple[int, ...], dtype: np.dtype, scale: float = 1.0
            ) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return dtypes.round_to(values, dtype)


def _inputs(spec: NormSpec, dtype: np.dtype, param: np.dtype, shape: tuple[int, ...] = (5, 40)
            ) -> Inputs:
    """Unit normals (a mean of 0.5 for LayerNorm), parameters near 1 (the offset's: near 0),
    and the residual, gate or alpha the spec has."""
    x = _normal(0, shape, dtype) + (0.5 if spec.kind == "layer" else 0)
    x = dtypes.round_to(x, dtype)
    n = spec.param_shape(shape)
    scale = bias = residual = dh = alpha = gate = None
    if spec.scale:
        scale = dtypes.round_to(1 - spec.scale_offset + _normal(2, n, F32, 0.1), param)
    if spec.bias:
        bias = _normal(3, n, param, 0.1)
    if spec.residual is not None:
        residual = _normal(4, shape, F32 if spec.residual == "float32" and param == F32 else dtype)
        dh = _normal(5, shape, residual.dtype)
    if spec.kind == "dyt":
        alpha = np.array([0.7], param)
    if spec.gate is not None:
        gate = _normal(6, shape, dtype, 2.0)
    return Inputs(x, _normal(1, shape, dtype), scale, bias, residual, dh, alpha, gate)


# Each option once, and the pairs that interact: (spec, input dtype, parameter dtype).
OPTIONS: dict[str, tuple[NormSpec, np.dtype, np.dtype]] = {
    "rms": (NormSpec(), F32, F32),
    "rms-bf16": (NormSpec(), BF16, F32),
    "rms-f16-bias-outside": (NormSpec(bias=True, eps_placement="outside"), F16, F32),
    "rms-no-scale": (NormSpec(scale=False), BF16, F32),
    "rms-llama-cast": (NormSpec(eps=1e-5, cast="before_scale"), BF16, BF16),
    "rms-gemma-offset": (NormSpec(scale_offset=1.0), BF16, F32),
    "rms-offset-in-param-dtype": (NormSpec(scale_offset=1.0, offset_dtype="param"), BF16, BF16),
    "rms-offset-param-before-cast": (
        NormSpec(scale_offset=1.0, offset_dtype="param", cast="before_scale"), F16, F16),
    "rms-promote": (NormSpec(output_dtype="promote", cast="before_scale"), BF16, F32),
    "rms-promote-half-params": (NormSpec(output_dtype="promote", bias=True), F32, BF16),
    "partial": (NormSpec("partial_rms", p=0.25), F32, F32),
    "partial-k1-outside": (NormSpec("partial_rms", p=0.01, eps_placement="outside"), F32, F32),
    "partial-bf16-bias": (NormSpec("partial_rms", p=0.5, bias=True), BF16, F32),
    "layer": (NormSpec("layer"), F32, F32),
    "layer-bf16-outside": (NormSpec("layer", eps_placement="outside"), BF16, F32),
    "layer-f16-cast": (NormSpec("layer", cast="before_scale"), F16, F32),
    "layer-fast": (NormSpec("layer", variance="fast"), F32, F32),
    "layer-fast-bf16": (NormSpec("layer", variance="fast", output_dtype="promote"), BF16, F32),
    "dyt": (NormSpec("dyt"), F32, F32),
    "dyt-bf16-cast-no-bias": (NormSpec("dyt", bias=False, cast="before_scale"), BF16, F32),
    "residual-rounded": (NormSpec(residual="rounded"), BF16, F32),
    "residual-float32": (NormSpec(residual="float32"), BF16, F32),
    "residual-float32-normalized-layer": (
        NormSpec("layer", residual="float32_normalized", cast="before_scale"), F16, F32),
    "residual-float32-x-float32": (NormSpec(residual="float32"), F32, F32),
    "residual-dyt": (NormSpec("dyt", residual="rounded"), BF16, F32),
    "gate-before-mamba2": (
        NormSpec(gate="before", cast="before_scale", output_dtype="promote"), BF16, F32),
    "gate-after-qwen3-next": (NormSpec(gate="after", cast="before_scale"), BF16, BF16),
    "gate-after-sigmoid-bias": (
        NormSpec(gate="after", gate_activation="sigmoid", bias=True), F32, F32),
    "gate-before-layer-sigmoid": (
        NormSpec("layer", gate="before", gate_activation="sigmoid"), F32, F32),
    "gate-after-partial": (NormSpec("partial_rms", p=0.5, gate="after"), BF16, F32),
    "groups": (NormSpec(group_size=10), F32, F32),
    "groups-layer-f16": (NormSpec("layer", group_size=8), F16, F32),
    "groups-gate-before": (NormSpec(gate="before", group_size=10, cast="before_scale"), BF16, F32),
    "groups-layer-gate-after-outside": (
        NormSpec("layer", gate="after", group_size=20, eps_placement="outside", bias=True,
                 scale_offset=1.0), BF16, F32),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_every_option(name: str) -> None:
    spec, dtype, param = OPTIONS[name]
    check(spec, _inputs(spec, dtype, param))


def test_layer_rows_of_two_and_one() -> None:
    """LayerNorm rows of two (the gradient's closed form) and RMS rows of one."""
    check(NormSpec("layer"), _inputs(NormSpec("layer"), F32, F32, (6, 2)))
    check(NormSpec(eps_placement="outside"), _inputs(NormSpec(), F32, F32, (6, 1)))


SLICED = {name: OPTIONS[name] for name in (
    "rms-bf16", "rms-f16-bias-outside", "partial-k1-outside", "partial-bf16-bias", "layer",
    "layer-fast", "dyt", "residual-float32-normalized-layer", "gate-before-mamba2",
    "gate-after-sigmoid-bias", "groups-layer-gate-after-outside", "rms-offset-in-param-dtype",
)}


@pytest.mark.parametrize("name", SLICED)
def test_the_backward_in_slices(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows longer than the backward holds whole (here: 16 elements) are taken in slices (of
    8), their statistic and sums computed first from the whole rows."""
    from normkit import _pallas

    monkeypatch.setitem(_pallas.LAUNCH, "fused", 16)
    monkeypatch.setitem(_pallas.LAUNCH, "slice", 8)
    spec, dtype, param = SLICED[name]
    check(spec, _inputs(spec, dtype, param))


def test_leading_axes_and_many_tiles() -> None:
    """Rows over several leading axes, more tiles than the backward has programs."""
    spec = NormSpec(bias=True)
    check(spec, _inputs(spec, BF16, F32, (3, 7, 6)))


# ---- the edges -------------------------------------------------------------------------------

SCALES = np.array([1.0, 1e20, 3e38, 1e15, 1e-30, 1e-38, 1.0])


def _far_scales(spec: NormSpec) -> Inputs:
    """Rows of scale 1e-38 .. 3e38 (x**2 overflows float32 above 1.8e19, underflows below
    1e-19) beside ordinary ones; dy scaled so that the gradients are normal float32 numbers."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((len(SCALES), 24)) * SCALES[:, None]
    x[2] = np.sign(x[2]) * 3e38
    dy = rng.standard_normal(x.shape) * np.minimum(SCALES, 1e30)[:, None]
    w = np.linspace(0.5, 1.5, 24)
    return Inputs(x.astype(F32), dy.astype(F32), w.astype(F32))


def _large_cotangents(spec: NormSpec) -> Inputs:
    """|x| ~ 1e9 with dy ~ 1e29 and dy ~ 1e37: sum dy x overflows float32, sum dy y_hat
    does not (or nearly)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 16)) * np.array([1e9, 1.0, 1e9, 1.0])[:, None]
    dy = rng.standard_normal(x.shape) * np.array([1e29, 1.0, 1.0, 1e37])[:, None]
    return Inputs(x.astype(F32), dy.astype(F32), np.linspace(0.5, 1.5, 16).astype(F32))


def _large_mean(spec: NormSpec) -> Inputs:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 200)) + np.array([1e6, 1e4, -3e5])[:, None]).astype(F32)
    return Inputs(x, rng.standard_normal(x.shape).astype(F32),
                  np.linspace(0.5, 1.5, 200).astype(F32), np.zeros(200, F32))


def _tiny_rows(spec: NormSpec) -> Inputs:
    """Rows whose statistic's squares underflow float32: four read elements at 1e-12, 1e-25
    and 1e-30, the rest ones (partial RMS) or zeros; a row of one tiny element."""
    x = np.zeros((4, 16))
    for row, scale in enumerate((1e-12, 1e-25, 1e-30)):
        x[row, :4] = np.array([1.0, 0.0, -1 / 3, 1 / 7]) * scale
        x[row, 4:] = 1.0 if spec.kind == "partial_rms" else 0.0
    x[3, 0] = 1e-25
    dy = np.linspace(-1.0, 2.0, x.size).reshape(x.shape)
    return Inputs(x.astype(F32), dy.astype(F32), np.linspace(0.5, 1.5, 16).astype(F32))


def _nan_inf_rows(spec: NormSpec) -> Inputs:
    x = np.random.default_rng(3).standard_normal((5, 10)).astype(F32)
    x[0, 7], x[1, 2], x[2, 0], x[3, 4] = np.nan, np.inf, 1e30, -np.inf
    return Inputs(x, _normal(13, x.shape, F32))


KINDS = {"rms": {}, "partial": {"kind": "partial_rms", "p": 0.25}, "layer": {"kind": "layer"}}
EDGES = {
    f"{edge}-{name}-{placement}": (NormSpec(**kind, eps_placement=placement), make)
    for edge, make in (("far_scales", _far_scales), ("large_cotangents", _large_cotangents))
    for name, kind in KINDS.items() for placement in ("inside", "outside")
}
EDGES.update({
    f"tiny_rows-{name}-outside": (NormSpec(**kind, eps=1e-5, eps_placement="outside"),
                                  _tiny_rows)
    for name, kind in (("rms", {}), ("partial-k4", {"kind": "partial_rms", "p": 0.25}),
                       ("partial-k1", {"kind": "partial_rms", "p": 1 / 16}))
})
EDGES.update({
    f"large_mean-{placement}": (NormSpec("layer", eps_placement=placement), _large_mean)
    for placement in ("inside", "outside")
})
EDGES["smallest_eps"] = (NormSpec(eps=2.0**-126), _tiny_rows)
# the fast variance's roundings where its steps overflow float32 and where the mean is large
EDGES["far_scales-layer-fast"] = (NormSpec("layer", variance="fast"), _far_scales)
EDGES["large_mean-layer-fast"] = (NormSpec("layer", variance="fast"), _large_mean)
EDGES["far_scales-gate-after"] = (NormSpec(gate="after"), _far_scales)


@pytest.mark.parametrize("name", EDGES)
def test_edges(name: str) -> None:
    spec, make = EDGES[name]
    inputs = make(spec)
    if spec.gate is not None:
        inputs = inputs._replace(gate=_normal(6, inputs.x.shape, F32))
    check(spec, inputs)


@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_infinity_stay_in_their_rows(kind: str) -> None:
    spec = NormSpec(**KINDS[kind], bias=True)
    got = check(spec, _nan_inf_rows(spec))
    for name in ("y", "dx"):
        value = np.asarray(got[name], np.float64)
        assert np.isfinite(value[4]).all(), name


# ---- compiled on a GPU ----------------------------------------------------------------------


def _gpu() -> str:
    gpus = [d for d in targets_jax.devices() if d.startswith("cuda")]
    if not gpus:
        pytest.skip("JAX sees no GPU")
    return gpus[0]


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*(f"option-{n}" for n in OPTIONS), *(f"edge-{n}" for n in EDGES)])
def test_compiled_on_a_gpu(name: str) -> None:
    """Every option and every edge row through the kernels compiled for the GPU (Triton)."""
    device = _gpu()
    group, _, key = name.partition("-")
    if group == "option":
        spec, dtype, param = OPTIONS[key]
        check(spec, _inputs(spec, dtype, param), device)
        return
    spec, make = EDGES[key]
    inputs = make(spec)
    if spec.gate is not None:
        inputs = inputs._replace(gate=_normal(6, inputs.x.shape, F32))
    check(spec, inputs, device)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_compiled_on_a_gpu_long_rows(kind: str) -> None:
    """Rows of 16384 and of 20000 (padded to 32768): the backward in slices, compiled."""
    device = _gpu()
    spec = NormSpec(kind, bias=True)
    for n in (16384, 20000):
        check(spec, _inputs(spec, BF16, F32, (4, n)), device)


# ---- the call-time mask ----------------------------------------------------------------------

def _masked_rows(layer: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rows with a random mask, with one element masked in (two for LayerNorm: the gradient's
    closed form), with none (NaN), with NaN and a huge value masked out, with a large mean."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 24)).astype(F32)
    mask = rng.random(x.shape) < 0.6
    mask[1] = False
    mask[1, 3:3 + (2 if layer else 1)] = True
    mask[2] = False
    x[3, mask[3] == 0] = np.nan
    x[4, 5], mask[4, 5] = 1e20, False
    x[5] += 1e4
    return x, mask


@pytest.mark.parametrize("spec", [
    NormSpec(), NormSpec(eps_placement="outside", bias=True), NormSpec("layer"),
    NormSpec("layer", variance="fast", eps_placement="outside"),
], ids=["rms", "rms-outside-bias", "layer", "layer-fast-outside"])
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_the_mask(spec: NormSpec, sliced: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mask=`` through the kernels: the statistic over the elements masked in, every element
    normalized with it, the closed form per row, a row with none masked in NaN; rows whole and
    in slices."""
    from normkit import _pallas, reference, tolerances

    if sliced:
        monkeypatch.setitem(_pallas.LAUNCH, "fused", 16)
        monkeypatch.setitem(_pallas.LAUNCH, "slice", 8)
    x, mask = _masked_rows(spec.kind == "layer")
    dy = _normal(1, x.shape, F32)
    w = (1 + _normal(2, (24,), F32, 0.1)).astype(F32)
    b = _normal(3, (24,), F32, 0.1) if spec.bias else None

    def run(x: Any, w: Any, b: Any) -> Any:
        return functional.normalize(x, spec, w, b, mask=mask, implementation="pallas")

    with pallas.interpreted():
        assert "pallas_call" in str(jax.make_jaxpr(run)(x, w, b))
        y, vjp = jax.vjp(jax.jit(run), x, w, b)
        dx, dw, _ = vjp(dy)
    want = reference.normalize(x, spec, w, b, mask=mask)
    grads = reference.normalize_vjp(x, dy, spec, w, b, mask=mask)
    ordinary = [0, 1, 4, 5]  # the rows the reference gives finite values
    tolerances.assert_close(np.asarray(y)[ordinary], want[ordinary], F32)
    tolerances.assert_close(np.asarray(dx)[ordinary], grads.dx[ordinary], F32, "grad")
    assert np.isnan(np.asarray(y)[2]).all() and np.isnan(np.asarray(y)[3][mask[3] == 0]).all()
    assert np.isfinite(np.asarray(y)[3][mask[3]]).all()
    del dw
