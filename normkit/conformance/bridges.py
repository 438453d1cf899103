"""Bridges between numpy and each framework: run a framework function forward and backward.

One small class per framework, its framework imported only when the bridge is first used. A
bridge runs ``fn(x, scale, bias) -> y`` (scale/bias None when absent) on numpy inputs and
returns ``(y, dx, dscale, dbias)`` as numpy arrays in the dtypes the framework produced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from normkit import dtypes

Outputs = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]
FrameworkFn = Callable[[Any, Any, Any], Any]


class Bridge(Protocol):
    name: str

    def devices(self) -> list[str]: ...

    def forward(self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, device: str) -> np.ndarray: ...

    def vjp(
        self, fn: FrameworkFn, x: np.ndarray, dy: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, device: str
    ) -> Outputs: ...


def _half_safe(a: np.ndarray) -> np.ndarray:
    """float32 for half arrays (which it holds exactly), for frameworks that cannot read ml_dtypes."""
    return a.astype(np.float32) if dtypes.is_half(a.dtype) else a


def _back(values: np.ndarray, dtype: Any) -> np.ndarray:
    return np.asarray(values).astype(dtypes.as_float_dtype(dtype, "a result"))


class TorchBridge:
    name = "torch"

    def devices(self) -> list[str]:
        from normkit.torch.conformance import devices

        return devices()

    def tensors(self, arrays: tuple[np.ndarray | None, ...], device: str, grad: bool) -> list[Any]:
        from normkit.torch.conformance import to_torch

        return [None if a is None else to_torch(a, device).requires_grad_(grad) for a in arrays]

    def forward(self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, device: str) -> np.ndarray:
        import torch

        from normkit.torch.conformance import to_numpy

        with torch.no_grad():
            return to_numpy(fn(*self.tensors((x, scale, bias), device, grad=False)))

    def vjp(self, fn: FrameworkFn, x: np.ndarray, dy: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, device: str) -> Outputs:
        from normkit.torch.conformance import to_numpy, to_torch

        inputs = self.tensors((x, scale, bias), device, grad=True)
        y = fn(*inputs)
        y.backward(to_torch(dy, device).to(y.dtype))
        grads = [None if t is None else to_numpy(t.grad) for t in inputs]
        return to_numpy(y), grads[0], grads[1], grads[2]  # type: ignore[return-value]


class JaxBridge:
    name = "jax"

    def devices(self) -> list[str]:
        import jax

        return ["cpu"] + [f"{d.platform}:{d.id}" for d in jax.devices() if d.platform != "cpu"]

    def _put(self, arrays: tuple[np.ndarray | None, ...], device: str) -> list[Any]:
        import jax

        platform, _, index = device.partition(":")
        target = jax.devices(platform)[int(index or 0)]
        return [None if a is None else jax.device_put(a, target) for a in arrays]

    def forward(self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, device: str) -> np.ndarray:
        y = fn(*self._put((x, scale, bias), device))
        return _back(y, y.dtype)

    def vjp(self, fn: FrameworkFn, x: np.ndarray, dy: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, device: str) -> Outputs:
        import jax

        xj, sj, bj, dyj = self._put((x, scale, bias, dy), device)
        y, pullback = jax.vjp(fn, xj, sj, bj)
        dx, ds, db = pullback(dyj.astype(y.dtype))
        return _back(y, y.dtype), _back(dx, dx.dtype), *(None if g is None else _back(g, g.dtype) for g in (ds, db))  # type: ignore[return-value]


class TensorFlowBridge:
    name = "tf"

    def devices(self) -> list[str]:
        import tensorflow as tf

        return ["cpu"] + [f"gpu:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]

    def tensors(self, arrays: tuple[np.ndarray | None, ...]) -> list[Any]:
        """numpy arrays (None kept) as TensorFlow tensors of the same dtypes."""
        import tensorflow as tf

        return [None if a is None else tf.cast(tf.constant(_half_safe(a)), a.dtype.name) for a in arrays]

    def numpy(self, t: Any) -> np.ndarray:
        """A TensorFlow tensor as a numpy array of the same dtype (bfloat16 as ml_dtypes')."""
        import tensorflow as tf

        return _back(tf.cast(t, tf.float32 if t.dtype.size == 2 else t.dtype).numpy(), t.dtype.name)

    def forward(self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, device: str) -> np.ndarray:
        import tensorflow as tf

        with tf.device(device):
            return self.numpy(fn(*self.tensors((x, scale, bias))))

    def vjp(self, fn: FrameworkFn, x: np.ndarray, dy: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, device: str) -> Outputs:
        import tensorflow as tf

        with tf.device(device):
            inputs = self.tensors((x, scale, bias))
            with tf.GradientTape() as tape:
                for t in inputs:
                    if t is not None:
                        tape.watch(t)
                y = fn(*inputs)
            watched = [t for t in inputs if t is not None]
            found = iter(tape.gradient(y, watched, output_gradients=tf.cast(tf.constant(_half_safe(dy)), y.dtype)))
            grads = [None if t is None else self.numpy(next(found)) for t in inputs]
            return self.numpy(y), grads[0], grads[1], grads[2]  # type: ignore[return-value]


BRIDGES: dict[str, Bridge] = {b.name: b for b in (TorchBridge(), JaxBridge(), TensorFlowBridge())}


def get(name: str) -> Bridge:
    """The bridge for framework ``name`` (``"torch"``, ``"jax"`` or ``"tf"``)."""
    if name not in BRIDGES:
        raise ValueError(f"backend={name!r} is invalid: expected one of {sorted(BRIDGES)}")
    return BRIDGES[name]
