"""normkit.torch as a drop-in for torch.nn.LayerNorm / RMSNorm and torch.nn.functional's norms.

The constructor calls and inputs are those torch's own module tests use
(``torch/testing/_internal/common_modules.py``: ``module_inputs_torch_nn_LayerNorm`` and
``module_inputs_torch_nn_RMSNorm``), with torch's checks: outputs, state_dict, repr, the
attributes, devices and dtypes of the parameters, memory format, tracing and export.
"""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import normkit.torch as nt
from normkit import reference, tolerances
from normkit.spec import NormSpec
from normkit.torch import functional as nf

# (constructor args, constructor kwargs, input shape, desc) as in torch's common_modules.py.
LAYER_NORM_INPUTS = [
    (([5], 1e-3), {}, (4, 5, 5), "1d_elementwise_affine"),
    (([5], 1e-3), {}, (128, 5, 5), "1d_elementwise_affine_large_batch"),
    (([5], 1e-3, False), {}, (4, 5, 5), "1d_no_elementwise_affine"),
    (([2, 2, 5], 1e-3), {}, (4, 2, 2, 5), "3d_elementwise_affine"),
    (([2, 2, 5], 1e-3, False), {}, (4, 2, 2, 5), "3d_no_elementwise_affine"),
    (([5], 1e-3), {}, (0, 5), "1d_empty_elementwise_affine"),
    (([2, 2, 5], 1e-3), {"elementwise_affine": True, "bias": False}, (4, 2, 2, 5),
     "3d_elementwise_affine_no_bias"),
    (([5],), {}, (4, 5), "default_eps"),
]
RMS_NORM_INPUTS = [
    (([5], 1e-3), {}, (4, 5, 5), "1d_elementwise_affine"),
    (([5], 1e-3), {}, (128, 5, 5), "1d_elementwise_affine_large_batch"),
    (([5], 1e-3, False), {}, (4, 5, 5), "1d_no_elementwise_affine"),
    (([2, 2, 5], 1e-3), {}, (4, 2, 2, 5), "3d_elementwise_affine"),
    (([2, 2, 5], 1e-3, False), {}, (4, 2, 2, 5), "3d_no_elementwise_affine"),
    (([5], 1e-3), {}, (0, 5), "1d_empty_elementwise_affine"),
    (([5],), {}, (4, 5), "eps_none"),
]
PAIRS = [
    (nn.LayerNorm, nt.LayerNorm, case) for case in LAYER_NORM_INPUTS
] + [(nn.RMSNorm, nt.RMSNorm, case) for case in RMS_NORM_INPUTS]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def ids(pair):
    return f"{pair[0].__name__}-{pair[2][3]}"


def build(pair, dtype):
    """torch's module and normkit's, built by the same call, with the same random parameters."""
    theirs_cls, ours_cls, (args, kwargs, _, _) = pair
    theirs = theirs_cls(*args, **kwargs, dtype=dtype)
    ours = ours_cls(*args, **kwargs, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=generator))
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("pair", PAIRS, ids=ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_module_inputs_give_torchs_outputs_and_gradients(pair, dtype):
    theirs, ours = build(pair, dtype)
    shape = pair[2][2]
    x = (2 * torch.randn(shape, generator=torch.Generator().manual_seed(1))).to(dtype)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert ours.normalized_shape == theirs.normalized_shape
    assert ours.eps == theirs.eps and ours.elementwise_affine == theirs.elementwise_affine
    xt, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yt, yo = theirs(xt), ours(xo)
    assert yo.dtype == yt.dtype == dtype and yo.shape == yt.shape
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    yt.backward(dy)
    yo.backward(dy)
    if x.numel() == 0:
        return
    # Both follow the spec within one rounding of the exact value, so they agree within twice
    # the dtype's bound (conformance's pairwise check). Not the gradients in bfloat16, where
    # torch's layers miss the spec by tens to thousands of ulp (docs/peers.md): normkit's are
    # checked against the reference by the conformance matrix.
    name = str(dtype).removeprefix("torch.")
    compared = [("y", yo, yt)]
    if dtype != torch.bfloat16:
        compared.append(("dx", xo.grad, xt.grad))
        compared += [
            (f"d{n}", po.grad, pt.grad)
            for (n, po), (_, pt) in zip(ours.named_parameters(), theirs.named_parameters())
        ]
    for what, a, b in compared:
        m = tolerances.measure(
            a.detach().double().numpy(), b.detach().double().numpy(), dtype=name,
            quantity="forward" if what == "y" else "grad",
        )
        assert m.error <= 2 * m.bound.value, (what, m)


@pytest.mark.parametrize("pair", PAIRS, ids=ids)
def test_spec_is_what_the_call_computes(pair):
    """The module's spec, evaluated by the reference in float64, is its float32 output."""
    _, ours = build(pair, torch.float32)
    shape = pair[2][2]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    w = None if ours.weight is None else ours.weight.detach().numpy()
    b = None if ours.bias is None else ours.bias.detach().numpy()
    expected = reference.normalize(x.double().numpy(), ours.spec, w, b)
    tolerances.assert_close(ours(x).detach().numpy(), expected, what=repr(ours))


def test_torch_positional_order_and_defaults():
    layer = nt.LayerNorm([5], 1e-3, False)
    assert (layer.eps, layer.elementwise_affine, layer.weight, layer.bias) == (1e-3, False, None, None)
    assert nt.LayerNorm(5, 1e-4, True, False).bias is None
    assert nt.LayerNorm(5).spec == NormSpec(kind="layer", eps=1e-5)
    rms = nt.RMSNorm([5], 1e-3, False, "cpu", torch.float64)
    assert (rms.eps, rms.weight, rms.spec.eps) == (1e-3, None, 1e-3)
    default = nt.RMSNorm(5, dtype=torch.float64)
    assert default.eps is None
    assert default.spec == NormSpec(kind="rms", eps=torch.finfo(torch.float32).eps)
    assert default.spec_for(torch.float64).eps == torch.finfo(torch.float64).eps
    assert default.spec_for(torch.bfloat16) == default.spec
    for ours, theirs in [
        (nt.LayerNorm(5, 1e-5, True, True, "cpu", torch.float64),
         torch.nn.LayerNorm(5, 1e-5, True, True, "cpu", torch.float64)),
        (nt.RMSNorm(5, None, True, "cpu", torch.float64),
         torch.nn.RMSNorm(5, None, True, "cpu", torch.float64)),
    ]:
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        for name, value in theirs.state_dict().items():
            assert (ours.state_dict()[name].dtype, ours.state_dict()[name].device) == (
                value.dtype, value.device), name
    assert nt.PartialRMSNorm(8, 0.5, 1e-4, False).spec == NormSpec(
        kind="partial_rms", p=0.5, eps=1e-4, scale=False
    )


def test_repr_starts_as_torchs():
    assert repr(nt.LayerNorm(5, 1e-3, False)).startswith(
        "LayerNorm((5,), eps=0.001, elementwise_affine=False"
    )
    assert repr(nt.RMSNorm(5)).startswith("RMSNorm((5,), eps=None, elementwise_affine=True")


def test_state_dicts_load_both_ways_and_reset_parameters_restores_the_init():
    for theirs, ours in [
        (nn.LayerNorm(6, elementwise_affine=False), nt.LayerNorm(6, elementwise_affine=False)),
        (nn.LayerNorm(6, bias=False), nt.LayerNorm(6, bias=False)),
        (nn.RMSNorm(6), nt.RMSNorm(6)),
    ]:
        ours.load_state_dict(theirs.state_dict())
        theirs.load_state_dict(ours.state_dict())
        for p in ours.parameters():
            p.data.fill_(3.0)
        ours.reset_parameters()
        theirs.reset_parameters()
        for (n, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
            assert torch.equal(a, b), n


def test_from_spec_builds_a_bias_without_a_scale():
    spec = NormSpec(kind="layer", eps=1e-5, scale=False, bias=True)
    module = nt.from_spec(spec, 4)
    assert module.spec == spec and module.weight is None and module.bias is not None


def test_functional_arguments_in_torchs_order():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 6, generator=g)
    w, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    torch.testing.assert_close(
        nf.layer_norm(x, (6,), w, b, 1e-3),
        torch.nn.functional.layer_norm(x, (6,), w, b, 1e-3), rtol=0, atol=2e-6,
    )
    torch.testing.assert_close(
        nf.rms_norm(x, [6], w, 1e-3), torch.nn.functional.rms_norm(x, [6], w, 1e-3),
        rtol=0, atol=2e-6,
    )
    small = 1e-4 * x.double()
    # eps=None: torch's rule, float64's machine eps for float64 inputs
    torch.testing.assert_close(
        nf.rms_norm(small, (6,)), torch.nn.functional.rms_norm(small, (6,)), rtol=1e-12, atol=0
    )
    expected = reference.normalize(
        x.numpy().astype(np.float64), NormSpec(eps=1e-3, bias=True), w.numpy(), b.numpy()
    )
    tolerances.assert_close(nf.rms_norm(x, 6, w, 1e-3, bias=b).numpy(), expected)
    assert nf.layer_norm(input=x, normalized_shape=[6]).shape == x.shape
    with pytest.raises(TypeError, match="input must be a torch.Tensor, got list"):
        nf.rms_norm([1.0], 1)
    with pytest.raises(TypeError, match="input must be a torch.Tensor, got list"):
        nf.layer_norm([1.0], 1)


@pytest.mark.parametrize("module", [nt.LayerNorm(5), nt.RMSNorm(5), nt.DyT(5)], ids=repr)
@pytest.mark.parametrize(
    "layout, shape", [(torch.channels_last, (2, 3, 4, 5)), (torch.channels_last_3d, (2, 3, 2, 4, 5))]
)
def test_the_input_memory_format_is_kept(module, layout, shape):
    x = torch.randn(shape).to(memory_format=layout).requires_grad_()
    y = module(x)
    assert y.is_contiguous(memory_format=layout) and not y.is_contiguous()
    torch.testing.assert_close(y, module(x.contiguous()), rtol=0, atol=0)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autocast_leaves_the_norms_as_torchs_own(dtype):
    """On the CPU, autocast runs torch's norms in the input's dtype; normkit's do the same."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, generator=g).to(dtype)
    for theirs, ours in [(nn.LayerNorm(8), nt.LayerNorm(8)), (nn.RMSNorm(8), nt.RMSNorm(8))]:
        expected = ours(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ours(x)
            assert y.dtype == theirs(x).dtype == dtype
        assert torch.equal(y, expected)


def test_autocast_runs_the_norms_in_float32_where_torchs_own_ops_are(monkeypatch):
    """Where a device's autocast registers torch's layer_norm and rms_norm (CUDA: in float32),
    normkit's norms run on float32 inputs too; checked on the CPU by reading CUDA's
    registrations for it. DyT, which torch lacks, keeps its input dtype."""
    from normkit.torch import _plan

    monkeypatch.setitem(_plan._AUTOCAST_KEYS, "cpu", "AutocastCUDA")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5)).bfloat16()
    for module in (nt.LayerNorm(8), nt.RMSNorm(8), nt.PartialRMSNorm(8, 0.5)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        assert y.dtype == torch.float32
        assert torch.equal(y, module(x.float()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert nt.DyT(8)(x).dtype == torch.bfloat16


def tiny_model():
    return nn.Sequential(
        nt.DyT(8), nt.PartialRMSNorm(8, 0.5), nn.Linear(8, 8), nt.RMSNorm(8), nt.LayerNorm(8)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_jit_trace_records_the_norms(dtype):
    """A traced graph holds torch ops (the eager op sequence), whatever the kernel: its outputs
    are the spec's within the tolerance policy, on inputs of another batch size too."""
    torch.manual_seed(0)
    model = tiny_model().to(dtype)
    x = torch.randn(3, 8, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, x)
    other = torch.randn(7, 8, dtype=dtype)
    y = traced(other)
    assert y.dtype == dtype
    tolerances.assert_close(
        y.float().detach().numpy(), model(other).double().detach().numpy(),
        dtype=str(dtype).removeprefix("torch."), what="traced model",
    )


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_onnx_export_runs_in_onnxruntime(dynamo, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = tiny_model().eval()
    x = torch.randn(3, 8)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=dynamo, input_names=["x"])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x.numpy()})
    with torch.no_grad():
        expected = model(x).double().numpy()
    tolerances.assert_close(y, expected, what=f"ONNX export (dynamo={dynamo})")


def train(model, steps=20):
    """20 SGD steps on a fixed regression problem; the final parameters."""
    g = torch.Generator().manual_seed(6)
    x, target = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kernel", ["auto", "composite"])
@pytest.mark.parametrize(
    "theirs, ours", [(nn.LayerNorm, nt.LayerNorm), (nn.RMSNorm, nt.RMSNorm)],
    ids=["LayerNorm", "RMSNorm"],
)
def test_a_tiny_model_trains_as_with_torchs_norm(theirs, ours, kernel):
    """20 SGD steps with the norm swapped. Each step is within one float32 rounding of the exact
    one (torch's own RMSNorm is a composite, its LayerNorm a fused kernel; normkit's composite
    path and CPU kernel accumulate in other orders), and after 20 steps the parameters agree
    within the float32 forward bound (1e-6 of the largest)."""
    def model(norm):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), norm, nn.Tanh(), nn.Linear(8, 8))

    a = train(model(theirs(8)))
    b = train(model(ours(8, kernel=kernel)))
    assert a.keys() == b.keys()
    largest = max(float(p.abs().max()) for p in a.values())
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6 * largest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_jit_script_compiles_saves_and_loads_the_norms(dtype, tmp_path):
    """torch.jit.script compiles the eager op sequence with the module's own parameters: the
    spec's outputs within the tolerance policy, after a save and load too, torch's eps=None
    rule included."""
    torch.manual_seed(0)
    model = nn.Sequential(
        tiny_model(), nt.RMSNorm(8, 1e-5, scale_offset=1.0, cast="before_scale"),
        nt.RMSNorm(8, output_dtype="promote"), nt.LayerNorm(8, bias=False),
    ).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(model)
        torch.jit.save(scripted, str(tmp_path / "model.pt"))
        loaded = torch.jit.load(str(tmp_path / "model.pt"))
    assert loaded.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(5, 8, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        for y in (scripted(x), loaded(x)):
            assert y.dtype == expected.dtype == dtype
            tolerances.assert_close(
                y.double().numpy(), expected.double().numpy(),
                dtype=str(dtype).removeprefix("torch."), what="scripted model",
            )


def test_jit_script_refuses_a_residual_module_naming_trace():
    with pytest.raises(ValueError, match=r"residual='rounded' returns \(y, h\).*torch.jit.trace"):
        torch.jit.script(nt.RMSNorm(8, residual="rounded"))
