"""`normkit.port.load_modules`: a norms file's layers as modules of each framework, no model
needed; each computes its spec with the file's parameters (against the numpy reference)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from normkit import NormSpec, port, reference

LAYERS = {
    "layers.0.input_layernorm": NormSpec("rms", eps=1e-6, scale_offset=1.0),  # Gemma's
    "layers.0.mlp_norm": NormSpec("layer", eps=1e-5),
    "final": NormSpec("rms", eps=1e-5, cast="before_scale"),
    "dyt": NormSpec("dyt"),
}
N = 16


@pytest.fixture(scope="module")
def norms_file(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("safetensors")
    rng = np.random.default_rng(0)
    layers = {}
    for name, spec in LAYERS.items():
        params = {"weight": rng.normal(spec.scale_init, 0.1, N).astype(np.float32)}
        if spec.bias:
            params["bias"] = rng.normal(0.0, 0.1, N).astype(np.float32)
        if spec.kind == "dyt":
            params["alpha"] = np.array([0.7], np.float32)
        layers[name] = (params, spec)
    path = tmp_path_factory.mktemp("modules") / "norms.safetensors"
    return port.save_norms(path, layers, convention="torch"), layers


def expected(layers, name, x):
    params, spec = layers[name]
    if spec.kind == "dyt":
        spec = spec.replace(alpha_init=float(params["alpha"][0]))
    return reference.normalize(x.astype(np.float64), spec, params["weight"], params.get("bias"))


def check(outputs, layers, x):
    assert set(outputs) == set(LAYERS)
    for name, y in outputs.items():
        want = expected(layers, name, x)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-6, atol=2e-6,
                                   err_msg=name)


X = np.random.default_rng(1).normal(0.5, 2.0, (3, N)).astype(np.float32)


def test_torch(norms_file):
    torch = pytest.importorskip("torch")
    path, layers = norms_file
    modules = port.load_modules(path, "torch")
    assert all(m.spec == LAYERS[n].replace(axis=(-1,)) for n, m in modules.items())
    with torch.no_grad():
        check({n: m(torch.from_numpy(X)).numpy() for n, m in modules.items()}, layers, X)


def test_keras(norms_file):
    pytest.importorskip("keras")
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("Keras' default backend, TensorFlow, is not installed")
    path, layers = norms_file
    modules = port.load_modules(path, "keras")
    check({n: np.asarray(m(X)) for n, m in modules.items()}, layers, X)


def test_flax_nnx_and_linen(norms_file):
    pytest.importorskip("flax")
    path, layers = norms_file
    nnx_modules = port.load_modules(path, "nnx")
    assert {n: m.spec.scale_offset for n, m in nnx_modules.items()}["layers.0.input_layernorm"] == 1
    check({n: np.asarray(m(X)) for n, m in nnx_modules.items()}, layers, X)
    linen = port.load_modules(path, "linen")
    check({n: np.asarray(m.apply(v, X)) for n, (m, v) in linen.items()}, layers, X)


def test_a_framework_that_is_not_one_is_refused(norms_file):
    with pytest.raises(ValueError, match="not one of"):
        port.load_modules(norms_file[0], "mxnet")  # type: ignore[arg-type]
