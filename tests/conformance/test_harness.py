"""The seam and the harness written once: every bridge's VJP of several inputs, outputs and named
parameters; the harness's checks and initial parameters; the compilation caches of the
workers."""

import importlib.util
import os

import numpy as np
import pytest

from normkit import conformance
from normkit.bridges import JaxBridge, TensorFlowBridge, TorchBridge
from normkit.conformance.compare import Inputs
from normkit.conformance.harness import check_inputs, initial_params
from normkit.conformance.worker import jax_compilation_cache, tf_compilation_cache
from normkit.spec import NormSpec

BRIDGES = [
    pytest.param(bridge, marks=pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{module} not installed"
    ), id=bridge.name)
    for bridge, module in (
        (TorchBridge(), "torch"), (JaxBridge(), "jax"), (TensorFlowBridge(), "tensorflow")
    )
]


def gated(x, gate, *, w):
    """Two inputs, a named parameter and two outputs: ``(x * gate * w, x + gate)``."""
    return x * gate * w, x + gate


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("bridge", BRIDGES)
def test_vjp_takes_every_primal_output_and_named_parameter(bridge, jit):
    if jit and bridge.name == "torch":
        with pytest.raises(ValueError, match="compile fn with torch.compile"):
            bridge.vjp(gated, (np.ones(2),), (np.ones(2),), {}, jit=True)
        return
    rng = np.random.default_rng(0)
    x, gate, c1, c2 = (rng.standard_normal((3, 4)) for _ in range(4))
    w = rng.standard_normal(4)
    outputs, (dx, dgate), dparams = bridge.vjp(gated, (x, gate), (c1, c2), {"w": w}, jit=jit)
    np.testing.assert_allclose(outputs[0], x * gate * w, rtol=1e-12)
    np.testing.assert_allclose(outputs[1], x + gate, rtol=1e-12)
    np.testing.assert_allclose(dx, c1 * gate * w + c2, rtol=1e-12)
    np.testing.assert_allclose(dgate, c1 * x * w + c2, rtol=1e-12)
    np.testing.assert_allclose(dparams["w"], (c1 * x * gate).sum(axis=0), rtol=1e-12)
    assert outputs[0].dtype == dx.dtype == dparams["w"].dtype == np.float64


@pytest.mark.parametrize("bridge", BRIDGES)
def test_vjp_needs_one_cotangent_per_output(bridge):
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="fn returned 2 outputs but 1 cotangents were given"):
        bridge.vjp(gated, (x, x), (x,), {"w": np.ones(4, np.float32)})


def test_check_inputs_names_the_problem():
    x = np.ones((2, 4), np.float32)
    check_inputs(
        NormSpec(residual="rounded"), Inputs(x, x, scale=np.ones(4, np.float32), residual=x, dh=x)
    )
    with pytest.raises(ValueError, match=r"dy has shape \(2, 3\), expected the shape of x"):
        check_inputs(NormSpec(), Inputs(x, x[:, :3]))
    with pytest.raises(ValueError, match="residual='rounded', residual given: True, dh given: False"):
        check_inputs(NormSpec(residual="rounded"), Inputs(x, x, residual=x))
    with pytest.raises(ValueError, match=r"dh has shape \(4,\), expected the shape of x"):
        check_inputs(NormSpec(residual="rounded"), Inputs(x, x, residual=x, dh=x[0]))
    with pytest.raises(ValueError, match=r"alpha has shape \(\), expected \(1,\)"):
        check_inputs(NormSpec("dyt"), Inputs(x, x, alpha=np.float32(1)))
    with pytest.raises(ValueError, match="bias was given but the spec has bias=False"):
        check_inputs(NormSpec(), Inputs(x, x, bias=np.zeros(4, np.float32)))
    with pytest.raises(ValueError, match="the spec has gate='after', gate given: False"):
        check_inputs(NormSpec(gate="after"), Inputs(x, x))
    with pytest.raises(ValueError, match=r"gate has shape \(2, 3\), expected the shape of x"):
        check_inputs(NormSpec(gate="after"), Inputs(x, x, gate=x[:, :3]))
    with pytest.raises(TypeError, match="unexpected keyword argument 'weight'"):
        check_inputs(NormSpec(), Inputs(x, x, weight=x))


def test_initial_params_come_from_the_spec_in_the_dtype_of_those_given():
    spec = NormSpec("dyt", bias=True, alpha_init=0.75, scale_offset=-1.0)  # w starts at 2
    x = np.ones((3, 4), np.float32)
    params = initial_params(spec, Inputs(x, x))
    assert list(params) == ["scale", "bias", "alpha"]
    assert {p.dtype for p in params.values()} == {np.dtype(np.float32)}
    np.testing.assert_array_equal(params["scale"], np.full(4, 2.0))
    np.testing.assert_array_equal(params["bias"], np.zeros(4))
    np.testing.assert_array_equal(params["alpha"], [0.75])
    given = np.full(4, 3.0, np.float64)
    params = initial_params(spec, Inputs(x, x, scale=given))
    assert params["scale"] is given and params["alpha"].dtype == np.float64
    assert list(initial_params(NormSpec(scale=False), Inputs(x, x))) == []


def test_workers_keep_jax_compilations_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.delenv("NORMKIT_JAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jax_compilation_cache() == str(tmp_path / "normkit" / "jax")
    assert os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("NORMKIT_JAX_CACHE_DIR", "")
    assert jax_compilation_cache() == "" and "JAX_COMPILATION_CACHE_DIR" not in os.environ
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    assert jax_compilation_cache() == "/elsewhere"


def test_workers_keep_tensorflow_xla_compilations_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TF_XLA_FLAGS", raising=False)
    monkeypatch.delenv("NORMKIT_TF_XLA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = str(tmp_path / "normkit" / "tf-xla")
    assert tf_compilation_cache() == folder
    assert os.environ["TF_XLA_FLAGS"] == (
        f"--tf_xla_persistent_cache_directory={folder} "
        "--tf_xla_persistent_cache_device_types=CPU,GPU,TPU"
    )
    assert tf_compilation_cache() == folder  # named already: kept, not named twice
    assert os.environ["TF_XLA_FLAGS"].count("persistent_cache_directory") == 1
    monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_auto_jit=2")
    monkeypatch.setenv("NORMKIT_TF_XLA_CACHE_DIR", "")
    assert tf_compilation_cache() == "" and os.environ["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=2"


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax not installed")
def test_a_jax_worker_fills_the_cache_and_a_second_run_reads_it(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("NORMKIT_JAX_CACHE_DIR", str(tmp_path))
    chosen = dict(backends=["jax.functional"], kinds=["rms"], dtypes=["float32"], quick=True)
    first = conformance.run(**chosen, pairwise=False, progress=False)
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert entries and any(name.startswith("jit_program") for name in entries)
    second = conformance.run(**chosen, pairwise=False, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == entries  # nothing compiled anew
    assert [r.status for r in first.results] == [r.status for r in second.results]
    assert {r.status for r in second.results} == {"PASS"}


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tf not installed")
def test_keras_traces_one_vjp_per_spec_shape_and_signature():
    """Two cases of one spec and shape reuse the layer and its traced, compiled VJP, and the
    second gets its own inputs' results."""
    from normkit import bridges, reference, tolerances
    from normkit.conformance import targets_keras

    if targets_keras.keras_backend() != "tensorflow":
        pytest.skip("the TensorFlow backend's tf.function")
    spec = NormSpec("layer", bias=True)
    rng = np.random.default_rng(3)
    for _case in range(2):
        x, dy = (rng.standard_normal((3, 16)).astype(np.float32) for _ in range(2))
        y, dx, _, _ = targets_keras.evaluate(spec, x, dy, jit=True)
        tolerances.assert_close(y, reference.normalize(x, spec), quantity="forward")
        want = reference.normalize_vjp(x, dy, spec, np.ones(16, np.float32), np.zeros(16, np.float32))
        tolerances.assert_close(dx, want.dx, quantity="grad")
    fn = targets_keras.build(
        spec, (3, 16), np.dtype(np.float32), dtype=np.dtype(np.float32), device="cpu", jit=True
    )
    assert bridges._tf_program(fn, True).experimental_get_tracing_count() == 1
