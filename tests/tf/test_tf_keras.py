"""normkit.tf as a Keras citizen: serialization, policies, fit, tf.function, other backends."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# Keras imports its backend's framework (TensorFlow unless KERAS_BACKEND names another); where
# that is missing, the module skips with the missing module's name.
keras = pytest.importorskip("keras")

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.tf import LayerNorm, PartialRMSNorm, RMSNorm, from_spec  # noqa: E402

# Keras' TensorFlow backend converts tensors with np.array(x), which numpy 2 flags; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")

ROOT = Path(__file__).resolve().parents[2]
on_tensorflow = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="needs the TensorFlow Keras backend"
)

SPECS = [
    NormSpec("rms", scale_offset=1.0, axis=(1, 2), cast="before_scale"),
    NormSpec("partial_rms", p=0.25, eps_placement="outside", bias=True),
    NormSpec("layer", axis=1, eps=1e-3),
]


def _random_weights(layer: keras.layers.Layer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    layer.set_weights([w + 0.3 * rng.standard_normal(w.shape).astype(w.dtype) for w in layer.get_weights()])


# The extended fields' checks that run on every backend (a handful: the grid is TensorFlow's).
EXTENDED = [
    f"tests/tf/test_tf_extended.py::{name}"
    for name in (
        "test_handful_on_every_backend",
        "test_jit_on_every_backend",
        "test_autograd_is_the_eager_rounding_model_to_the_bit_on_every_backend",
    )
]


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_reference_checks_pass_on_other_keras_backends(backend):
    """tests/tf/test_tf_backend.py, test_tf_keras_extended.py, test_tf_edge_rows.py and the
    extended fields' handful in a fresh process with KERAS_BACKEND set."""
    env = {**os.environ, "KERAS_BACKEND": backend, "JAX_ENABLE_X64": "1"}
    # Two workers where pytest-xdist is installed: this process only waits meanwhile. The run
    # was 823 tests, 528 s alone on the 2-core machine, before test_tf_edge_rows.py (44 more on
    # JAX, 22 on torch); more beside the suite's other worker.
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") is not None else []
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/tf/test_tf_backend.py", *EXTENDED,
         "tests/tf/test_tf_keras_extended.py", "tests/tf/test_tf_edge_rows.py", "-q", "-p",
         "no:cacheprovider",
         "-W", "ignore::DeprecationWarning", *workers],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, summary


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_from_spec_builds_the_right_layer(spec):
    layer = from_spec(spec, name="norm")
    assert type(layer) is {"rms": RMSNorm, "partial_rms": PartialRMSNorm, "layer": LayerNorm}[spec.kind]
    assert layer.spec == spec
    assert layer.name == "norm"


def test_from_spec_needs_a_spec():
    with pytest.raises(TypeError, match=r"from_spec needs a normkit.NormSpec, got dict"):
        from_spec({"kind": "rms"})


def test_constructor_defaults_are_the_spec_defaults_but_layer_norm_eps_is_keras():
    assert RMSNorm().spec == NormSpec("rms")
    assert PartialRMSNorm(0.5).spec == NormSpec("partial_rms", p=0.5)
    # keras.layers.LayerNormalization's epsilon, 1e-3; the spec's default is 1e-6
    assert LayerNorm().spec == NormSpec("layer", eps=1e-3)
    assert LayerNorm(epsilon=1e-6).spec == NormSpec("layer")
    with pytest.raises(ValueError, match=r"NormSpec.p=1.5 is invalid"):
        PartialRMSNorm(1.5)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_get_config_round_trip(spec):
    layer = from_spec(spec, name="norm")
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    layer(x)
    _random_weights(layer, 1)
    config = layer.get_config()
    json.dumps(config)
    clone = type(layer).from_config(config)
    assert clone.spec == spec
    assert clone.get_config() == config
    clone(x)
    clone.set_weights(layer.get_weights())
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(clone(x)), keras.ops.convert_to_numpy(layer(x)))


_LOAD_AND_RUN = """
import json, sys
import numpy as np
import keras
import normkit.tf
model = keras.saving.load_model(sys.argv[1])
np.save(sys.argv[3], keras.ops.convert_to_numpy(model(np.load(sys.argv[2]))))
print(json.dumps([[l.spec.to_dict(), [w.name for w in l.weights]] for l in model.layers[1:]]))
"""


@on_tensorflow
def test_keras_file_loads_in_a_fresh_process_with_identical_outputs(tmp_path):
    inputs = keras.Input((3, 8))
    layers = [from_spec(spec) for spec in SPECS]
    y = inputs
    for layer in layers:
        y = layer(y)
    model = keras.Model(inputs, y)
    for seed, layer in enumerate(layers):
        _random_weights(layer, seed)
    x = np.random.default_rng(5).standard_normal((4, 3, 8)).astype(np.float32)
    expected = keras.ops.convert_to_numpy(model(x))
    model.save(tmp_path / "model.keras")
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_RUN, str(tmp_path / "model.keras"), str(tmp_path / "x.npy"),
         str(tmp_path / "y.npy")],
        cwd=ROOT, env={**os.environ, "KERAS_BACKEND": "tensorflow"}, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert [NormSpec.from_dict(d) for d, _ in loaded] == SPECS
    assert [names for _, names in loaded] == [["scale"], ["scale", "bias"], ["scale", "bias"]]


@on_tensorflow
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_model_fit_takes_the_reference_gradient_step(spec):
    """One SGD step (lr 1) in model.fit, XLA-compiled, moves the weights by the reference grad."""
    batch, shape = 4, (3, 8)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    dy = rng.standard_normal((batch, *shape)).astype(np.float32)
    layer = from_spec(spec)
    model = keras.Sequential([keras.Input(shape), layer])
    _random_weights(layer, 4)
    before = layer.get_weights()
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=1.0),
        loss=lambda t, y: keras.ops.sum(t * y, axis=(1, 2)),  # mean over the batch: d/dy = dy / batch
        jit_compile=True,
    )
    model.fit(x, dy, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    bias = before[1] if spec.bias else None
    _, dscale, dbias = reference.normalize_vjp(x, dy / batch, spec, before[0], bias)
    after = layer.get_weights()
    tolerances.assert_close(before[0] - after[0], dscale, quantity="grad", what="scale step")
    if spec.bias:
        tolerances.assert_close(before[1] - after[1], dbias, quantity="grad", what="bias step")


@pytest.mark.parametrize("policy,in_dtype,out_dtype", [
    ("float32", "bfloat16", "float32"),
    ("float32", "float64", "float32"),
    ("float64", "float16", "float64"),
    ("mixed_bfloat16", "float32", "bfloat16"),
    ("mixed_float16", "bfloat16", "float16"),
])
def test_symbolic_output_dtype_follows_the_policy(policy, in_dtype, out_dtype):
    """The compute dtype, as Keras' own layers' symbolic outputs."""
    x = keras.Input((4,), dtype=in_dtype)
    for ours, theirs in ((RMSNorm, keras.layers.RMSNormalization),
                         (LayerNorm, keras.layers.LayerNormalization)):
        y = ours(dtype=policy)(x)
        assert y.dtype == theirs(dtype=policy)(x).dtype == out_dtype
        assert y.shape == (None, 4)


def test_symbolic_integer_input_raises_type_error():
    with pytest.raises(TypeError, match=r"has dtype int32; LayerNorm needs a floating input"):
        LayerNorm()(keras.Input((4,), dtype="int32"))


def test_symbolic_call_with_other_sizes_raises_value_error():
    layer = LayerNorm(axis=1)
    layer(keras.Input((4, 3)))
    with pytest.raises(ValueError, match=r"axis 1 of the input \(shape \(None, 5, 3\)\) has size 5, but the layer was built for size 4"):
        layer(keras.Input((5, 3)))


def test_unknown_normalized_size_raises_value_error():
    with pytest.raises(ValueError, match=r"the normalized axes \(1,\) of input shape \(None, None\) must have known sizes"):
        RMSNorm().build((None, None))


def test_mask_passes_through():
    mask = np.array([[True, False]])
    assert RMSNorm().compute_mask(np.ones((1, 2, 4), np.float32), mask) is mask


def test_spec_is_read_only():
    with pytest.raises(AttributeError):
        RMSNorm().spec = NormSpec()


def test_missing_keras_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "normkit.tf" or m.startswith("normkit.tf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "keras", None)
    with pytest.raises(ImportError, match=re.escape(
        "normkit.tf needs Keras 3: pip install 'normkit[tf]' (Keras 3 with TensorFlow), or pip "
        "install 'normkit[keras]' (Keras 3 with JAX, then set KERAS_BACKEND=jax before Keras is "
        "imported)"
    )):
        importlib.import_module("normkit.tf")


def test_keras_2_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "normkit.tf" or m.startswith("normkit.tf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(keras, "__version__", "2.15.0")
    with pytest.raises(ImportError, match=re.escape(
        "normkit.tf needs Keras 3, found Keras 2.15.0: pip install 'normkit[tf]'"
    ) + ".*" + re.escape("pip install 'normkit[keras]'")):
        importlib.import_module("normkit.tf")


def test_devices_refuses_other_keras_backends(monkeypatch):
    from normkit.conformance import targets_keras as conformance

    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    with pytest.raises(RuntimeError, match=r"supports the tensorflow, jax and torch Keras backends, not 'numpy'"):
        conformance.devices()


@on_tensorflow
def test_bench_rows_time_each_layer_with_its_keras_peers_and_a_copy():
    from normkit.bench import tf as bench
    from normkit.bench.core import FIELDS, QUICK_TOKEN_ROUNDS, TOKEN_SHAPE, run

    rows = run(bench, quick=True, devices=["cpu"], dtypes=["float32"], timings=["latency"])
    # 2 shapes (1 swept, one token) x (forward, forward+backward) x (eager, XLA) groups of 4
    # layers and the copy
    assert len(rows) == 8 * 5
    by_key = {(r["implementation"], r["pass"], r["mode"], tuple(r["shape"])): r for r in rows}
    for (name, pass_, mode, shape), row in by_key.items():
        assert tuple(row) == FIELDS
        assert row["backend"] == "tf" and row["dtype"] == "float32" and row["device"] == "cpu"
        assert row["repeats"] == (QUICK_TOKEN_ROUNDS if shape == TOKEN_SHAPE else 3)
        if row["role"] == "copy floor":
            assert name == "copy (x * 1)" and row["fraction_of_copy_floor"] == 1.0
            continue
        assert set(row["ratios"]) == {
            "normkit.tf.RMSNorm", "keras.layers.RMSNormalization",
            "normkit.tf.LayerNorm", "keras.layers.LayerNormalization",
        } - {name}
        for peer_name, ratio in row["ratios"].items():
            peer = by_key[(peer_name, pass_, mode, shape)]
            assert ratio == pytest.approx(peer["median_s"] / row["median_s"])
