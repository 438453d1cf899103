"""Gated and grouped norms: NormSpec's ``gate``, ``gate_activation`` and ``group_size``.

The reference against formulas written out here (float64, loops and reshapes), its gradients
against central differences, its half-precision rounding points against the roundings spelled
out, and every installed Hugging Face gated norm class against the spec
`normkit.port.gated_classes` maps it to.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest

from normkit import NormSpec, dtypes, reference, tolerances
from normkit.port.gated_classes import GATED_CLASSES, NOT_A_GATED_NORM, GatedClass, gated_class

BF16 = dtypes.bfloat16


def activation(z: np.ndarray, name: str) -> np.ndarray:
    sigmoid = 1.0 / (1.0 + np.exp(-z))
    return z * sigmoid if name == "silu" else sigmoid


def y_hat_by_loops(v: np.ndarray, spec: NormSpec) -> np.ndarray:
    """The normalized rows of the 2-D ``v``: per group of ``group_size`` (or the whole row),
    one element at a time."""
    rows, n = v.shape
    size = spec.group_size or n
    out = np.empty_like(v)
    for i in range(rows):
        for start in range(0, n, size):
            part = v[i, start : start + size]
            c = part - math.fsum(part) / size if spec.kind == "layer" else part
            k = max(1, math.floor(size * spec.p)) if spec.kind == "partial_rms" else size
            s = math.fsum(float(value) ** 2 for value in c[:k]) / k
            if spec.eps_placement == "inside":
                r = 1.0 / math.sqrt(s + spec.eps)
            else:
                r = 1.0 / (math.sqrt(s) + spec.eps)
            out[i, start : start + size] = c * r
    return out


def gated_by_formula(x, z, spec, w, b):
    """``u(x a(z))`` or ``u(x) a(z)``, ``u`` the affine norm, on 2-D float64 arrays."""
    a = activation(z, spec.gate_activation)
    v = x * a if spec.gate == "before" else x
    u = y_hat_by_loops(v, spec) * (spec.scale_offset + w) + b
    return u * a if spec.gate == "after" else u


def draw(shape, n, seed=0, scale=1.5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * scale
    z = rng.standard_normal(shape) * 2.0
    w = rng.standard_normal(n) * 0.3 + 1.0
    b = rng.standard_normal(n) * 0.2
    dy = rng.standard_normal(shape)
    return x, z, w, b, dy


def gated_specs():
    """Every kind with either gate and activation, two settings each (eps inside, no offset,
    no bias; eps outside, Gemma's offset, bias), grouped where the kind allows it."""
    for kind, gate, act, (placement, offset, bias) in itertools.product(
        ("rms", "partial_rms", "layer"), ("before", "after"), ("silu", "sigmoid"),
        (("inside", 0.0, False), ("outside", 1.0, True)),
    ):
        yield NormSpec(
            kind, eps=1e-5 if placement == "inside" else 1e-3, eps_placement=placement,
            p=0.3 if kind == "partial_rms" else None, scale_offset=offset, bias=bias,
            gate=gate, gate_activation=act, group_size=4 if kind != "partial_rms" else None,
        )


GATED = list(gated_specs())


# ---- the spec ----------------------------------------------------------------------------------


def test_gate_activation_resolves_with_the_gate_only():
    assert NormSpec(gate="before").gate_activation == "silu"
    assert NormSpec("layer", gate="after", gate_activation="sigmoid").gate_activation == "sigmoid"
    assert NormSpec().gate_activation is None and NormSpec().group_size is None
    assert NormSpec(group_size=np.int64(8)).group_size == 8
    assert type(NormSpec(group_size=np.int64(8)).group_size) is int


def test_group_count_names_n_and_group_size():
    assert NormSpec(group_size=4).group_count(12) == 3
    assert NormSpec().group_count(12) == 1
    with pytest.raises(ValueError, match=r"group_size=5 does not divide the normalized size n=12"):
        NormSpec(group_size=5).group_count(12)


# ---- the forward against the formulas --------------------------------------------------------


@pytest.mark.parametrize("spec", GATED, ids=repr)
def test_gated_forward_matches_the_formula(spec):
    x, z, w, b, _ = draw((5, 12), 12)
    bias = b if spec.bias else None
    got = reference.gated_normalize(x, z, spec, w, bias)
    want = gated_by_formula(x, z, spec, w, b if spec.bias else 0.0)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_grouped_statistic_matches_a_reshape(kind, placement):
    """Groups of 4 over the two normalized axes (8 x 4 = 32 elements, row-major): the reshape
    to (rows, 8, 4) normalizes each group; one scale and bias over the whole row."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8, 4)) * 3 + 1
    w, b = rng.standard_normal((8, 4)), rng.standard_normal((8, 4))
    eps = 1e-4
    spec = NormSpec(kind, eps=eps, eps_placement=placement, axis=(-2, -1), bias=True,
                    group_size=4)
    groups = x.reshape(3, 8, 4)
    c = groups - groups.mean(-1, keepdims=True) if kind == "layer" else groups
    s = np.mean(c**2, -1, keepdims=True)
    r = 1 / np.sqrt(s + eps) if placement == "inside" else 1 / (np.sqrt(s) + eps)
    want = (c * r).reshape(x.shape) * w + b
    np.testing.assert_allclose(reference.normalize(x, spec, w, b), want, rtol=1e-12, atol=1e-13)
    whole = reference.normalize(x, spec.replace(group_size=None), w, b)
    assert not np.allclose(whole, want)
    assert np.array_equal(reference.normalize(x, spec.replace(group_size=32), w, b), whole)


@pytest.mark.parametrize(
    "dtype, cast, variance",
    [(BF16, "before_scale", "two_pass"), (np.float16, "after_scale", "two_pass"),
     (np.float32, "after_scale", "fast"), (BF16, "after_scale", "fast")],
)
def test_grouped_is_the_ungrouped_norm_of_each_group(dtype, cast, variance):
    """Every rounding of the policy (fast variance included) happens per group: the grouped
    norm of rows of 16 is the plain norm of the same values as rows of 4, bit for bit."""
    rng = np.random.default_rng(2)
    x = dtypes.round_to(rng.standard_normal((6, 16)) * 2 + 0.5, dtype)
    spec = NormSpec("layer", cast=cast, variance=variance, bias=False, group_size=4)
    got = reference.normalize(x, spec)
    want = reference.normalize(x.reshape(24, 4), spec.replace(group_size=None)).reshape(6, 16)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_half_precision_rounding_points(dtype):
    """Each order's roundings, spelled out: ``t`` the input dtype, ``a = act(z)`` exact."""
    rng = np.random.default_rng(3)
    x = dtypes.round_to(rng.standard_normal((8, 32)) * 2, dtype)
    z = dtypes.round_to(rng.standard_normal((8, 32)) * 2, dtype)
    w = dtypes.round_to(rng.standard_normal(32) * 0.5 + 1, dtype)
    w32 = w.astype(np.float32)
    x64, z64, w64 = (v.astype(np.float64) for v in (x, z, w))

    def t(v):
        return dtypes.round_to(v, dtype).astype(np.float64)

    def y_hat(v):
        return v / np.sqrt(np.mean(v**2, -1, keepdims=True) + 1e-6)

    a = activation(z64, "silu")
    cases = [
        # Mamba2: t(t(y_hat(x a)) w)
        ("before", "before_scale", w, t(t(y_hat(x64 * a)) * w64)),
        # Falcon-H1 norm_before_gate=False: t(y_hat(x a) w)
        ("before", "after_scale", w, t(y_hat(x64 * a) * w64)),
        # Qwen3-Next: t(t(t(y_hat(x)) w) a)
        ("after", "before_scale", w, t(t(t(y_hat(x64)) * w64) * a)),
        # Qwen3-Next with a float32 weight: the affine step is float32, not rounded
        ("after", "before_scale", w32, t(t(y_hat(x64)) * w64 * a)),
        # Kimi Linear: t(y_hat(x) w a)
        ("after", "after_scale", w, t(y_hat(x64) * w64 * a)),
    ]
    for gate, cast, weight, expected in cases:
        spec = NormSpec(cast=cast, gate=gate)
        got = reference.gated_normalize(x, z, spec, weight)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.astype(np.float64), expected, err_msg=f"{gate} {cast}")
    # the roundings matter: without the middle one Qwen3-Next's order differs
    assert not np.array_equal(t(t(t(y_hat(x64)) * w64) * a), t(t(y_hat(x64)) * w64 * a))


def test_promoted_output_and_the_gates_dtype():
    """The output dtype is the input's and the parameters' (the gate's takes no part); a
    float32 gate with a bfloat16 input computes the same as its bfloat16 values."""
    rng = np.random.default_rng(4)
    x = dtypes.round_to(rng.standard_normal((4, 16)), BF16)
    z = dtypes.round_to(rng.standard_normal((4, 16)), BF16)
    w = np.ones(16, np.float32)
    spec = NormSpec(gate="before", cast="before_scale", output_dtype="promote")
    assert reference.gated_normalize(x, z, spec, w).dtype == np.float32
    assert reference.gated_normalize(x, z, spec).dtype == BF16
    assert reference.gated_normalize(x, z.astype(np.float64), spec).dtype == BF16
    np.testing.assert_array_equal(
        reference.gated_normalize(x, z.astype(np.float32), spec, w),
        reference.gated_normalize(x, z, spec, w),
    )


def test_activation_is_accurate_for_large_gates():
    """``sigmoid(-z)`` for large z is taken without cancellation: the sigmoid gate's gradient
    at z = 40 is e^-40, not 0, and silu(-800) is -0.0, not NaN."""
    x = np.array([[1.0, -1.0]])
    z = np.array([[40.0, -800.0]])
    spec = NormSpec(gate="after", gate_activation="sigmoid", eps=1e-6)
    grads = reference.gated_normalize_vjp(x, z, np.ones_like(x), spec)
    r = 1 / math.sqrt(1 + 1e-6)
    np.testing.assert_allclose(grads.dgate[0, 0], r * math.exp(-40), rtol=1e-12)
    y = reference.gated_normalize(x, z, spec.replace(gate_activation="silu"))
    assert np.all(np.isfinite(y))


# ---- gradients against central differences ---------------------------------------------------


def central_differences(f, value, h=1e-6):
    grad = np.empty_like(value)
    for i in np.ndindex(value.shape):
        up, down = value.copy(), value.copy()
        up[i] += h
        down[i] -= h
        grad[i] = (f(up) - f(down)) / (2 * h)
    return grad


@pytest.mark.parametrize("spec", GATED, ids=repr)
def test_gradients_match_central_differences(spec):
    x, z, w, b, dy = draw((3, 8), 8, seed=5)
    bias = b if spec.bias else None
    got = reference.gated_normalize_vjp(x, z, dy, spec, w, bias)

    def loss(x=x, z=z, w=w, b=bias):
        return float(np.sum(dy * reference.gated_normalize(x, z, spec, w, b)))

    np.testing.assert_allclose(got.dx, central_differences(lambda v: loss(x=v), x), atol=1e-7)
    np.testing.assert_allclose(got.dgate, central_differences(lambda v: loss(z=v), z), atol=1e-7)
    np.testing.assert_allclose(got.dscale, central_differences(lambda v: loss(w=v), w), atol=1e-7)
    if spec.bias:
        np.testing.assert_allclose(
            got.dbias, central_differences(lambda v: loss(b=v), b), atol=1e-7
        )
    else:
        assert got.dbias is None


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_grouped_gradients_match_central_differences(kind):
    """Ungated groups over two axes, eps outside; and a group of one element (RMS) or two
    (LayerNorm), where the reference takes the statistic's closed form."""
    rng = np.random.default_rng(6)
    for shape, axis, size in (((2, 3, 4), (-2, -1), 6), ((2, 8), (-1,), 1 if kind == "rms" else 2)):
        x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
        w = rng.standard_normal(shape[1:]) + 1
        spec = NormSpec(kind, eps=1e-3, eps_placement="outside", axis=axis, group_size=size)
        got = reference.normalize_vjp(x, dy, spec, w)

        def loss(x=x, w=w, spec=spec, dy=dy):
            return float(np.sum(dy * reference.normalize(x, spec, w)))

        np.testing.assert_allclose(got.dx, central_differences(lambda v: loss(x=v), x), atol=1e-7)
        np.testing.assert_allclose(
            got.dscale, central_differences(lambda v: loss(w=v), w), atol=1e-7
        )


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field, detail",
    [
        ({"gate": "inside"}, "gate", "None or one of ('before', 'after')"),
        ({"gate": True}, "gate", "None or one of"),
        ({"kind": "dyt", "gate": "after"}, "gate", "not 'dyt'"),
        ({"gate": "after", "residual": "rounded"}, "gate", "residual='rounded'"),
        ({"gate": "before", "backward": "autograd"}, "backward", "ungated specs only"),
        ({"gate_activation": "silu"}, "gate_activation", "only with a gate"),
        ({"gate": "after", "gate_activation": "gelu"}, "gate_activation", "('silu', 'sigmoid')"),
        ({"group_size": 0}, "group_size", "positive int"),
        ({"group_size": 4.0}, "group_size", "positive int"),
        ({"group_size": True}, "group_size", "positive int"),
        ({"kind": "partial_rms", "p": 0.5, "group_size": 4}, "group_size", "first k"),
        ({"kind": "dyt", "group_size": 4}, "group_size", "no statistic"),
    ],
)
def test_invalid_gate_or_group_names_field_and_value(kwargs, field, detail):
    with pytest.raises(ValueError) as info:
        NormSpec(**kwargs)
    message = str(info.value)
    assert f"NormSpec.{field}={kwargs.get(field)!r} is invalid" in message
    assert detail in message


def test_the_reference_refuses_what_it_does_not_define():
    x = np.ones((2, 6))
    gated = NormSpec(gate="before")
    with pytest.raises(ValueError, match=r"normalize: the spec has gate='before'.*gated_normalize"):
        reference.normalize(x, gated)
    with pytest.raises(ValueError, match=r"normalize_vjp: the spec has gate='before'"):
        reference.normalize_vjp(x, x, gated)
    with pytest.raises(ValueError, match=r"gated_normalize needs a spec with a gate"):
        reference.gated_normalize(x, x, NormSpec())
    with pytest.raises(ValueError, match=r"gated_normalize_vjp needs a spec with a gate"):
        reference.gated_normalize_vjp(x, x, x, NormSpec())
    with pytest.raises(ValueError, match=r"gate has shape \(6,\), expected the shape of x"):
        reference.gated_normalize(x, np.ones(6), gated)
    with pytest.raises(TypeError, match=r"gate"):
        reference.gated_normalize(x, np.ones((2, 6), np.int32), gated)
    with pytest.raises(ValueError, match=r"group_size=4 does not divide the normalized size n=6"):
        reference.normalize(x, NormSpec(group_size=4))
    with pytest.raises(ValueError, match=r"group_size=4 does not divide .* n=6"):
        reference.gated_normalize_vjp(x, x, x, gated.replace(group_size=4))
    for spec in (NormSpec(group_size=3), NormSpec("layer", gate="after")):
        with pytest.raises(ValueError, match=r"mask is not defined with gate="):
            spec.check_maskable()
    with pytest.raises(ValueError, match=r"the spec has gate='before', and a gate was not given"):
        reference.scaled_magnitude(x, gated)
    with pytest.raises(ValueError, match=r"the spec has gate=None, and a gate was given"):
        reference.scaled_magnitude(x, NormSpec(), gate=x)
    with pytest.raises(ValueError, match=r"mask is not defined with gate=None or group_size=3"):
        reference.normalize(x, NormSpec(group_size=3), mask=np.ones(6, bool))


def test_fields_travel_through_dicts_and_require_defaults():
    spec = NormSpec("layer", gate="after", gate_activation="sigmoid", group_size=8)
    data = spec.to_dict()
    assert (data["gate"], data["gate_activation"], data["group_size"]) == ("after", "sigmoid", 8)
    assert NormSpec.from_dict(data) == spec and hash(NormSpec.from_dict(data)) == hash(spec)
    with pytest.raises(ValueError, match=r"^impl does not support NormSpec.gate='after'"):
        spec.require_defaults("impl")
    with pytest.raises(ValueError, match=r"^impl does not support NormSpec.group_size=8"):
        NormSpec(group_size=8).require_defaults("impl")


# ---- Hugging Face's gated classes --------------------------------------------------------------

HIDDEN = 64
GROUPS = {"group_size": 16, "n_groups": 4}  # 4 groups of 16 either way
HF_CASES = [pytest.param(c, id=c.name + "".join(f"-{k}={v}" for k, v in c.options))
            for c in GATED_CLASSES]


def _transformers_models() -> Path | None:
    found = importlib.util.find_spec("transformers")
    if found is None or found.origin is None:
        return None
    return Path(found.origin).parent / "models"


def test_every_installed_gated_class_is_in_the_table():
    models = _transformers_models()
    if models is None:
        pytest.skip("transformers is not installed")
    installed = set()
    for path in models.glob("*/modeling_*.py"):
        installed |= set(re.findall(r"^class (\w*(?:RMSNormGated|GatedRMSNorm))\(", path.read_text(),
                                    re.MULTILINE))
    assert installed, "no gated norm class found: the search is wrong"
    tabled = {c.name for c in GATED_CLASSES} | set(NOT_A_GATED_NORM)
    assert installed == tabled
    for entry in GATED_CLASSES:  # each entry names its class's real module
        assert f"class {entry.name}(" in (
            models / Path(*entry.module.split(".")[2:])
        ).with_suffix(".py").read_text()


def test_gated_class_lookup():
    assert gated_class("KimiLinearRMSNormGated").spec.gate_activation == "sigmoid"
    assert gated_class("FalconH1RMSNormGated", norm_before_gate=False).spec.gate == "before"
    with pytest.raises(KeyError, match="options"):
        gated_class("FalconH1RMSNormGated")
    with pytest.raises(KeyError, match="known"):
        gated_class("LlamaRMSNorm")
    entry = gated_class("MambaRMSNormGated")
    assert entry.spec_for(64, 1e-5, 16).group_size == 16
    assert entry.spec_for(64, 1e-5, 64).group_size is None
    assert gated_class("FalconH1RMSNormGated", norm_before_gate=True).spec_for(64, 1e-5, 4) == (
        gated_class("FalconH1RMSNormGated", norm_before_gate=True).spec.replace(
            eps=1e-5, group_size=16)
    )
    with pytest.raises(ValueError, match="does not split hidden_size=64"):
        entry.spec_for(64, 1e-5, 24)


def _build(entry: GatedClass, torch):
    cls = getattr(importlib.import_module(entry.module), entry.name)
    options = dict(entry.options)
    if entry.groups is not None:
        options[entry.groups] = GROUPS[entry.groups]
    torch.manual_seed(0)
    module = cls(HIDDEN, eps=1e-5, **options)
    with torch.no_grad():
        module.weight.copy_(torch.randn(HIDDEN) * 0.5 + 1)
    groups = None if entry.groups is None else GROUPS[entry.groups]
    return module, entry.spec_for(HIDDEN, 1e-5, groups)


def _numpy(tensor, dtype):
    return dtypes.round_to(tensor.detach().double().numpy(), dtype)


@pytest.mark.parametrize("entry", HF_CASES)
def test_hf_class_in_float64_and_float32(entry):
    """The module and its autograd gradients against the reference: float32 within normkit's
    bounds. ``module.double()`` is held to the same float32 bound, since every class upcasts
    to float32 (float64 inputs included)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    module, spec = _build(entry, torch)
    torch.manual_seed(1)
    x, z, dy = (torch.randn(3, 5, HIDDEN) * 2 for _ in range(3))
    for dtype in (torch.float64, torch.float32):
        module.to(dtype)
        module.zero_grad()
        xt, zt = (v.to(dtype).requires_grad_() for v in (x, z))
        y = module(xt, zt)
        y.backward(dy.to(dtype))
        args = [v.detach().numpy() for v in (xt, zt)]
        w = module.weight.detach().numpy()
        want = reference.gated_normalize(*args, spec, w)
        assert y.dtype == dtype and want.dtype == args[0].dtype
        tolerances.assert_close(y.detach().numpy(), want, np.float32, what=f"{dtype} y")
        grads = reference.gated_normalize_vjp(*args, dy.to(dtype).numpy(), spec, w)
        for name, got, expected in (("dx", xt.grad, grads.dx), ("dgate", zt.grad, grads.dgate),
                                    ("dscale", module.weight.grad, grads.dscale)):
            tolerances.assert_close(got.numpy(), expected, np.float32, "grad", what=name)
        if entry.gate_optional:  # forward(x): the same spec without its gate
            ungated = spec.replace(gate=None, gate_activation=None)
            plain = module(xt.detach()).detach().numpy()
            tolerances.assert_close(plain, reference.normalize(args[0], ungated, w), np.float32)


def _neighbours(spec: NormSpec) -> list[NormSpec]:
    """The specs one rounding or one gate position away: what a wrong table entry would be."""
    other_cast = "after_scale" if spec.cast == "before_scale" else "before_scale"
    return [spec.replace(cast=other_cast), spec.replace(gate="after" if spec.gate == "before"
                                                        else "before")]


@pytest.mark.parametrize("entry", HF_CASES)
@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_hf_class_in_half_precision(entry, half):
    """Half inputs, the weight in the input dtype and in float32: the output dtype is the
    spec's, every element within one ulp of the reference's rounding (at ``scaled_magnitude``
    with ``before_scale``), and at most 1 in 1000 elements not bit-identical (where torch's
    float32 arithmetic lands across a rounding midpoint). The neighbouring specs are not."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    module, spec = _build(entry, torch)
    dtype = dtypes.DTYPE_NAMES[half]
    torch.manual_seed(2)
    x, z = ((torch.randn(64, HIDDEN) * 2).to(getattr(torch, half)) for _ in range(2))
    xn, zn = _numpy(x, dtype), _numpy(z, dtype)
    for weight_dtype in (getattr(torch, half), torch.float32):
        module.to(weight_dtype)
        w = _numpy(module.weight, dtypes.DTYPE_NAMES[str(weight_dtype).removeprefix("torch.")])
        got = module(x, z).detach()
        want = reference.gated_normalize(xn, zn, spec, w)
        assert str(got.dtype).removeprefix("torch.") == want.dtype.name
        got64 = got.double().numpy()
        magnitude = reference.scaled_magnitude(xn, spec, w, gate=zn)
        tolerances.assert_close(_numpy(got, want.dtype), want, dtype, cast=spec.cast,
                                magnitude=magnitude, what=f"weight {weight_dtype}")
        differing = int(np.count_nonzero(got64 != want.astype(np.float64)))
        assert differing <= got64.size // 1000, f"{differing} of {got64.size} elements differ"
        for other in _neighbours(spec):
            near = reference.gated_normalize(xn, zn, other, w).astype(np.float64)
            assert np.count_nonzero(got64 != near) > 10 * max(differing, 1), other
