"""normkit.tf on Keras' JAX backend under ``jax.jit`` takes normkit's Pallas kernels when they are
selected (``NORMKIT_JAX_KERNELS=pallas``): the results in Pallas' interpreter against the
reference, forward and backward through ``stateless_call``; the CUDA export holds the kernels'
Triton calls; the CPU's compiled program is the one without the switch.

On another Keras backend this module runs itself again with ``KERAS_BACKEND=jax``, in a process
of its own (Keras' backend is fixed when it is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parents[2]
TRITON = "__gpu$xla.gpu.triton"

if keras.backend.backend() != "jax":

    def test_on_keras_jax_backend() -> None:
        env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

else:
    import jax
    import jax.numpy as jnp

    from normkit import NormSpec, reference, tolerances
    from normkit.jax import pallas
    from normkit.tf import from_spec

    def _stateless(layer: Any) -> tuple[Any, list[Any]]:
        """``apply(weights, x[, second])`` through ``stateless_call``, and the weights."""
        weights = [v.value for v in layer.trainable_variables]

        def apply(weights: list[Any], x: jax.Array, *second: Any) -> Any:
            return layer.stateless_call(weights, [], x, *second)[0]

        return apply, weights

    CASES = {
        "rms-mixed-bfloat16": (NormSpec(eps=1e-5, cast="before_scale"), "mixed_bfloat16"),
        "layer": (NormSpec("layer", eps=1e-3), "float32"),
        "partial-outside-bias": (
            NormSpec("partial_rms", p=0.25, eps_placement="outside", bias=True), "float32"),
        "gemma-offset": (NormSpec(scale_offset=1.0), "float32"),
        "dyt": (NormSpec("dyt"), "float32"),
    }

    @pytest.mark.parametrize("name", CASES)
    def test_the_kernels_compute_the_reference(name: str, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
        spec, policy = CASES[name]
        monkeypatch.setenv(pallas.KERNELS_VARIABLE, "pallas")
        rng = np.random.default_rng(0)
        layer = from_spec(spec, dtype=policy)
        shape = (5, 40)
        layer.build(shape)
        layer.set_weights([w + 0.1 * rng.standard_normal(w.shape).astype(w.dtype)
                           for w in layer.get_weights()])
        dtype = keras.DTypePolicy(policy).compute_dtype
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        dy = jnp.asarray(rng.standard_normal(shape), dtype)
        apply, weights = _stateless(layer)

        def run(weights: list[Any], x: jax.Array, dy: jax.Array) -> Any:
            y, vjp = jax.vjp(apply, weights, x)
            return y, vjp(dy)

        with pallas.interpreted():
            assert "pallas_call" in str(jax.make_jaxpr(run)(weights, x, dy))
            y, (_, dx) = jax.jit(run)(weights, x, dy)
        values = {w.path.split("/")[-1]: np.asarray(v) for w, v in
                  zip(layer.trainable_variables, weights, strict=True)}
        x64 = np.asarray(x, np.float64)
        params = (values.get("scale"), values.get("bias"))
        alpha = values.get("alpha")
        want = reference.normalize(np.asarray(x), spec, *params, alpha)
        grads = reference.normalize_vjp(np.asarray(x), np.asarray(dy), spec, *params, alpha)
        tolerances.assert_close(np.asarray(y), want, np.dtype(y.dtype), cast=spec.cast,
                                magnitude=reference.scaled_magnitude(x64, spec, params[0], alpha))
        tolerances.assert_close(np.asarray(dx), grads.dx, np.dtype(dx.dtype), "grad")

    def test_the_cuda_program_holds_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(pallas.KERNELS_VARIABLE, "pallas")
        layer = from_spec(NormSpec("layer"), dtype="mixed_bfloat16")
        layer.build((64, 1000))
        apply, weights = _stateless(layer)
        from tests.jax.test_jax_kernels_export import exported

        x = jnp.ones((64, 1000), jnp.bfloat16)
        assert exported(apply, (weights, x), "cuda").count(f"@{TRITON}") == 1

    @pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
    def test_the_cpu_program_is_unchanged_by_the_switch(
        backward: bool, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from tests.jax.test_jax_kernels_export import _program

        found = []
        for switch in ("xla", "pallas"):
            monkeypatch.setenv(pallas.KERNELS_VARIABLE, switch)
            layer = from_spec(NormSpec(), dtype="mixed_bfloat16")
            layer.build((64, 512))
            apply, weights = _stateless(layer)
            x = jnp.ones((64, 512), jnp.bfloat16)
            fn, args = apply, (weights, x)
            if backward:
                def fn(weights: list[Any], x: jax.Array, dy: jax.Array, apply: Any = apply
                       ) -> Any:
                    y, vjp = jax.vjp(apply, weights, x)
                    return y, vjp(dy)

                args = (weights, x, x)
            found.append(_program(jax.jit(fn).lower(*args).compile().as_text()))
        assert found[0] == found[1]
