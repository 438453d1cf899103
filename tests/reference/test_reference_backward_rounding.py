"""backward="autograd": the gradients autograd computes through the eager half-precision forward.

Checked against the model written out element by element, and against Hugging Face's
LlamaRMSNorm (and GemmaRMSNorm) in torch.
"""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from normkit import NormSpec, dtypes, reference, tolerances

BF16 = dtypes.bfloat16
LLAMA = NormSpec(
    eps=1e-6, cast="before_scale", backward="autograd", output_dtype="promote"
)


def round_bits(v, bits):
    """``v`` to ``bits`` significant bits, ties to even (normal range), by hand."""
    if v == 0:
        return 0.0
    _, e = math.frexp(v)
    return math.ldexp(round(math.ldexp(v, bits - e)), e - bits)


def llama_autograd_by_hand(x, w, dy, eps, bits):
    """RMSNorm with the Llama cast, x, w, dy in one half dtype of ``bits`` bits: autograd's
    roundings written out per element (float32 steps exact)."""
    rows, n = x.shape
    dx = np.empty((rows, n))
    products = np.empty((rows, n))
    for i in range(rows):
        row = [float(v) for v in x[i]]
        r = 1 / math.sqrt(math.fsum(v * v for v in row) / n + eps)
        z = [round_bits(v * r, bits) for v in row]
        dz = [round_bits(float(dy[i, j]) * float(w[j]), bits) for j in range(n)]
        dot = math.fsum(d * v for d, v in zip(dz, row))
        for j in range(n):
            dx[i, j] = round_bits(r * dz[j] - row[j] * r**3 * dot / n, bits)
            products[i, j] = round_bits(float(dy[i, j]) * z[j], bits)
    dw = [round_bits(math.fsum(products[:, j]), bits) for j in range(n)]
    return dx, np.array(dw)


@pytest.mark.parametrize("dtype, bits", [(BF16, 8), (np.float16, 11)])
def test_matches_the_model_written_out(dtype, bits):
    rng = np.random.default_rng(0)
    x = dtypes.round_to(rng.normal(size=(5, 12)) * 2, dtype)
    w = dtypes.round_to(rng.normal(size=12) * 0.5 + 1, dtype)
    dy = dtypes.round_to(rng.normal(size=(5, 12)), dtype)
    got = reference.normalize_vjp(x, dy, LLAMA, w)
    want_dx, want_dw = llama_autograd_by_hand(x, w, dy, 1e-6, bits)
    assert got.dx.dtype == got.dscale.dtype == dtype
    np.testing.assert_array_equal(got.dx.astype(np.float64), want_dx)
    np.testing.assert_array_equal(got.dscale.astype(np.float64), want_dw)


def test_hand_case_where_autograd_and_exact_differ():
    # One row x = (1, -1), w = (1.5, 1), dy = (1 + 2^-7, 0); r = 1 / sqrt(1 + eps).
    # Autograd rounds dz = dy * w to bfloat16: 1.5 (1 + 2^-7) = 1.51171875 lies halfway between
    # 1.5078125 and 1.515625 (spacing 2^-7), ties to even give 1.515625. Then, with dz_1 = 0,
    #     dx_0 = r dz_0 - r^3 dz_0 / 2        dx_1 = r^3 dz_0 / 2.
    # dx_1 is 0.7578125 (1 - 1.5e-6), which rounds to 0.7578125; the exact gradient's is
    # 0.755859375 (1 - 1.5e-6), just below a tie (spacing 2^-8), which rounds to 0.75390625.
    x = np.array([[1.0, -1.0]], dtype=BF16)
    w = np.array([1.5, 1.0], dtype=BF16)
    dy = np.array([[1 + 2.0**-7, 0.0]], dtype=BF16)
    auto = reference.normalize_vjp(x, dy, LLAMA, w)
    exact = reference.normalize_vjp(x, dy, LLAMA.replace(backward="exact"), w)
    r = 1 / math.sqrt(1 + 1e-6)

    def dx(dz):
        return [r * dz - r**3 * dz / 2, r**3 * dz / 2]

    assert auto.dx.astype(np.float64)[0].tolist() == [
        round_bits(v, 8) for v in dx(1.515625)
    ]
    np.testing.assert_allclose(exact.dx[0], dx(1.51171875), rtol=1e-15)
    assert float(auto.dx[0, 1]) == 0.7578125
    assert float(dtypes.round_to(exact.dx, BF16)[0, 1]) == 0.75390625


def test_after_scale_and_full_precision_are_the_exact_gradients_rounded_once():
    rng = np.random.default_rng(1)
    for dtype in (BF16, np.float16, np.float32):
        x = dtypes.round_to(rng.normal(size=(4, 8)), dtype)
        dy = dtypes.round_to(rng.normal(size=(4, 8)), dtype)
        w = dtypes.round_to(rng.normal(size=8), dtype)
        for spec in (
            NormSpec("layer", backward="autograd"),
            LLAMA.replace(kind="partial_rms", p=0.5),
        ):
            if spec.cast == "before_scale" and dtypes.is_half(dtype):
                continue
            auto = reference.normalize_vjp(x, dy, spec, w)
            exact = reference.normalize_vjp(x, dy, spec.replace(backward="exact"), w)
            np.testing.assert_array_equal(auto.dx, dtypes.round_to(exact.dx, dtype))
            np.testing.assert_array_equal(
                auto.dscale, dtypes.round_to(exact.dscale, dtype)
            )
            assert (
                auto.dbias is None or auto.dbias.dtype == np.float32
            )  # absent bias: float32


# ---- Hugging Face's LlamaRMSNorm and GemmaRMSNorm in torch ----------------------------------


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The torch results of hf_norm_grads_worker.py, run in its own process."""
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    path = tmp_path_factory.mktemp("hf") / "hf.npz"
    worker = Path(__file__).with_name("hf_norm_grads_worker.py")
    done = subprocess.run(
        [sys.executable, str(worker), str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(path) as data:
        return dict(data)


def case(hf, tag, dtypes_by_name):
    """The arrays of ``tag``, each in its torch dtype (bfloat16 via ml_dtypes)."""
    return {k: hf[f"{tag}/{k}"].astype(d) for k, d in dtypes_by_name.items()}


def raw_ulps(actual, expected, dtype):
    e = np.asarray(expected, np.float64)
    return np.abs(np.asarray(actual, np.float64) - e) / dtypes.ulp(e, dtype)


def product_magnitude(x, dy):
    """Per feature, the largest |dy * z| the scale gradient sums (z: the rounded y_hat)."""
    z = reference.normalize(x, LLAMA.replace(output_dtype="input", scale=False))
    return np.max(np.abs(dy.astype(np.float64) * z.astype(np.float64)), axis=0)


HALF = {"bfloat16": BF16, "float16": np.dtype(np.float16)}


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hugging_face_llama_gradients_within_one_ulp(hf, half, seed):
    t = HALF[half]
    a = case(
        hf,
        f"llama/{half}/{half}/{seed}",
        {k: t for k in ("x", "w", "y", "dy", "dx", "dw")},
    )
    tolerances.assert_close(
        a["y"], reference.normalize(a["x"], LLAMA, a["w"]), what="y"
    )
    auto = reference.normalize_vjp(a["x"], a["dy"], LLAMA, a["w"])
    dx_ulps = raw_ulps(a["dx"], auto.dx, t)
    assert dx_ulps.max() <= 1.0
    assert np.mean(dx_ulps == 0) >= 0.999
    # dscale sums dy * z; where torch's float32 y_hat rounds z the other way (a float32
    # near-tie, about one element in 10^5), that product moves by up to one ulp of itself.
    magnitude = product_magnitude(a["x"], a["dy"])
    m = tolerances.measure(a["dw"], auto.dscale, quantity="grad", magnitude=magnitude)
    assert m.max_ulp <= 1.0, m.describe()
    assert np.mean(raw_ulps(a["dw"], auto.dscale, t) == 0) >= 0.99
    # the exact gradients, rounded once, are not what autograd computes
    exact = reference.normalize_vjp(
        a["x"], a["dy"], LLAMA.replace(backward="exact"), a["w"]
    )
    assert raw_ulps(a["dx"], exact.dx, t).max() > 2


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_hugging_face_llama_with_float32_weight_promotes(hf, half):
    t, f32 = HALF[half], np.dtype(np.float32)
    a = case(
        hf,
        f"llama/{half}/float32/3",
        {"x": t, "w": f32, "y": f32, "dy": f32, "dx": t, "dw": f32},
    )
    assert reference.output_dtype(t, LLAMA, a["w"]) == f32
    tolerances.assert_close(
        a["y"],
        reference.normalize(a["x"], LLAMA, a["w"]),
        t,
        cast="before_scale",
        what="y",
        magnitude=reference.scaled_magnitude(a["x"], LLAMA, a["w"]),
    )
    auto = reference.normalize_vjp(a["x"], a["dy"], LLAMA, a["w"])
    assert raw_ulps(a["dx"], auto.dx, t).max() <= 1.0
    assert auto.dscale.dtype == f32
    # float32 sums of the products; a z rounded the other way moves one by an ulp of the
    # input dtype at that product's size
    magnitude = product_magnitude(a["x"], a["dy"])
    m = tolerances.measure(a["dw"], auto.dscale, t, "grad", magnitude=magnitude)
    assert m.max_ulp <= 1.0, m.describe()


def test_hugging_face_residual_add_then_llama_norm(hf):
    t = BF16
    a = case(
        hf,
        "residual",
        {k: t for k in ("x", "res", "w", "h", "y", "dy", "dh", "dx", "dres")},
    )
    spec = LLAMA.replace(residual="rounded")
    y, h = reference.add_normalize(a["x"], a["res"], spec, a["w"])
    np.testing.assert_array_equal(a["h"], h)
    tolerances.assert_close(a["y"], y, what="y")
    got = reference.add_normalize_vjp(a["x"], a["res"], a["dy"], a["dh"], spec, a["w"])
    assert raw_ulps(a["dx"], got.dx, t).max() <= 1.0
    np.testing.assert_array_equal(a["dx"], a["dres"])
    np.testing.assert_array_equal(got.dx, got.dresidual)


def test_hugging_face_gemma_after_scale_is_exact_rounded_once(hf):
    t = BF16
    a = case(hf, "gemma", {k: t for k in ("x", "w", "y", "dy", "dx", "dw")})
    spec = NormSpec(eps=1e-6, scale_offset=1.0, backward="autograd")
    tolerances.assert_close(a["y"], reference.normalize(a["x"], spec, a["w"]), what="y")
    auto = reference.normalize_vjp(a["x"], a["dy"], spec, a["w"])
    assert raw_ulps(a["dx"], auto.dx, t).max() <= 1.0
    assert raw_ulps(a["dw"], auto.dscale, t).max() <= 1.0
