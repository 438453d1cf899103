"""The seam between the harness and a framework: the `Bridge` protocol, normkit's device names,
and one bridge per framework (numpy <-> tensors, devices, forward and VJP).

Each class imports its framework inside its methods, so this module imports none; use
`normkit.backends.bridge` to get one. Devices take normkit's names (``cpu``, ``cuda:N`` with
``gpu:N`` accepted, ``tpu:N``, ``mps``); a device the framework does not see is a ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from normkit import dtypes

__all__ = [
    "Bridge", "FrameworkFn", "JaxBridge", "Outputs", "TensorFlowBridge", "TorchBridge",
    "device_index", "device_name",
]

Outputs = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]
"""``(y, dx, dscale, dbias)`` as numpy arrays; None for a parameter that is absent."""
FrameworkFn = Callable[[Any, Any, Any], Any]
"""``fn(x, scale, bias) -> y`` on a framework's tensors (``scale``/``bias`` None when absent)."""

DEVICE_KINDS = ("cpu", "cuda", "tpu", "mps")
_DEVICE = re.compile(r"(cpu|cuda|gpu|tpu|mps)(?::(\d+))?")


def device_name(name: str) -> str:
    """The normkit name of a device: ``cpu``, ``cuda:N``, ``tpu:N`` or ``mps``.

    ``gpu:N`` is read as ``cuda:N``, a bare ``cuda``/``gpu``/``tpu`` as index 0, ``cpu:0`` as
    ``cpu``; anything else raises ValueError.
    """
    found = _DEVICE.fullmatch(name.strip().lower())
    if found is None:
        raise ValueError(
            f"{name!r} is not a device name: expected cpu, cuda:N (alias gpu:N), tpu:N or mps"
        )
    kind, index = found.groups()
    if kind in ("cpu", "mps"):
        if index not in (None, "0"):
            raise ValueError(f"{name!r} is not a device name: {kind} has no index")
        return kind
    return f"{'cuda' if kind == 'gpu' else kind}:{int(index or 0)}"


def device_index(name: str) -> tuple[str, int]:
    """``(kind, index)`` of a device name, e.g. ``("cuda", 1)`` for ``gpu:1``."""
    kind, _, index = device_name(name).partition(":")
    return kind, int(index or 0)


class Bridge(Protocol):
    """What a framework gives the harness; one small class per framework below."""

    name: str

    def devices(self) -> list[str]:
        """The devices the framework sees, in normkit's names, ``cpu`` first."""
        ...

    def to_tensor(self, a: np.ndarray, device: str = "cpu") -> Any:
        """A numpy array (ml_dtypes' bfloat16 included) as a tensor of its dtype on ``device``."""
        ...

    def to_numpy(self, t: Any) -> np.ndarray:
        """A tensor as a numpy array of its dtype (bfloat16 as ml_dtypes'), on the host."""
        ...

    def forward(
        self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None,
        bias: np.ndarray | None, device: str,
    ) -> np.ndarray:
        """``fn(x, scale, bias)`` on ``device``, as numpy."""
        ...

    def vjp(
        self, fn: FrameworkFn, x: np.ndarray, dy: np.ndarray, scale: np.ndarray | None,
        bias: np.ndarray | None, device: str,
    ) -> Outputs:
        """``y = fn(x, scale, bias)`` and the gradients of ``<y, dy>`` by x, scale and bias."""
        ...



def _checked(bridge: Any, device: str) -> str:
    """``device`` in normkit's name; ValueError unless ``bridge`` sees it."""
    name = device_name(device)
    seen = bridge.devices()
    if name not in seen:
        raise ValueError(f"device {device!r} is not one {bridge.name} sees: {seen}")
    return name


def _half_safe(a: np.ndarray) -> np.ndarray:
    """float32 for half arrays (which it holds exactly), for frameworks without ml_dtypes."""
    return a.astype(np.float32) if dtypes.is_half(a.dtype) else a


def _as(values: Any, dtype: Any) -> np.ndarray:
    return np.asarray(values).astype(dtypes.as_float_dtype(dtype, "a result"))


class TorchBridge:
    """PyTorch: ``cpu``, ``cuda:N``, ``mps``."""

    name = "torch"

    def devices(self) -> list[str]:
        import torch

        found = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if torch.backends.mps.is_available():
            found.append("mps")
        return found

    def to_tensor(self, a: np.ndarray, device: str = "cpu") -> Any:
        import torch

        # A copy: the tensor owns its memory (a view of ``a`` would alias the caller's array).
        a = np.array(a, copy=True, order="C")
        place = device_name(device)
        if a.dtype == dtypes.bfloat16:
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).to(place)
        return torch.from_numpy(a).to(place)

    def to_numpy(self, t: Any) -> np.ndarray:
        import torch

        # A copy: ``Tensor.numpy`` on ``t``'s own storage would mark it non-resizable for good
        # (which breaks FSDP2, whose parameters are freed by resizing their storage).
        t = t.detach().to("cpu", copy=True)
        if t.dtype == torch.bfloat16:
            return np.asarray(t.view(torch.uint16).numpy().view(dtypes.bfloat16))
        return np.asarray(t.numpy())

    def _tensors(self, arrays: tuple[np.ndarray | None, ...], device: str, grad: bool) -> list[Any]:
        return [
            None if a is None else self.to_tensor(a, device).requires_grad_(grad) for a in arrays
        ]

    def forward(
        self,
        fn: FrameworkFn,
        x: np.ndarray,
        scale: np.ndarray | None,
        bias: np.ndarray | None,
        device: str,
    ) -> np.ndarray:
        import torch

        place = _checked(self, device)
        with torch.no_grad():
            return self.to_numpy(fn(*self._tensors((x, scale, bias), place, grad=False)))

    def vjp(
        self,
        fn: FrameworkFn,
        x: np.ndarray,
        dy: np.ndarray,
        scale: np.ndarray | None,
        bias: np.ndarray | None,
        device: str,
    ) -> Outputs:
        place = _checked(self, device)
        inputs = self._tensors((x, scale, bias), place, grad=True)
        y = fn(*inputs)
        y.backward(self.to_tensor(dy, place).to(y.dtype))
        dx, dscale, dbias = (None if t is None else self.to_numpy(t.grad) for t in inputs)
        assert dx is not None
        return self.to_numpy(y), dx, dscale, dbias


class JaxBridge:
    """JAX: ``cpu``, ``cuda:N`` (JAX's ``gpu`` platform), ``tpu:N``."""

    name = "jax"

    def devices(self) -> list[str]:
        import contextlib

        import jax

        names = ["cpu"]
        for platform, kind in (("gpu", "cuda"), ("tpu", "tpu")):
            with contextlib.suppress(RuntimeError):
                names += [f"{kind}:{i}" for i in range(len(jax.devices(platform)))]
        return names

    def device(self, name: str) -> Any:
        """The ``jax.Device`` called ``name``; ValueError if JAX does not see it."""
        import jax

        kind, index = device_index(_checked(self, name))
        return jax.devices({"cuda": "gpu"}.get(kind, kind))[index]

    def to_tensor(self, a: np.ndarray, device: str = "cpu") -> Any:
        import jax

        return jax.device_put(a, self.device(device))

    def to_numpy(self, t: Any) -> np.ndarray:
        return _as(t, t.dtype)

    def forward(
        self,
        fn: FrameworkFn,
        x: np.ndarray,
        scale: np.ndarray | None,
        bias: np.ndarray | None,
        device: str,
    ) -> np.ndarray:
        return self.to_numpy(
            fn(*(None if a is None else self.to_tensor(a, device) for a in (x, scale, bias)))
        )

    def vjp(
        self,
        fn: FrameworkFn,
        x: np.ndarray,
        dy: np.ndarray,
        scale: np.ndarray | None,
        bias: np.ndarray | None,
        device: str,
    ) -> Outputs:
        import jax

        xj, sj, bj, dyj = (
            None if a is None else self.to_tensor(a, device) for a in (x, scale, bias, dy)
        )
        y, pullback = jax.vjp(fn, xj, sj, bj)
        dx, ds, db = pullback(dyj.astype(y.dtype))  # type: ignore[union-attr]
        return (
            self.to_numpy(y),
            self.to_numpy(dx),
            *(None if g is None else self.to_numpy(g) for g in (ds, db)),
        )  # type: ignore[return-value]


class TensorFlowBridge:
    """TensorFlow: ``cpu``, ``cuda:N`` (TensorFlow's ``GPU:N``)."""

    name = "tf"

    def devices(self) -> list[str]:
        import tensorflow as tf

        return ["cpu"] + [f"cuda:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]

    def device(self, name: str) -> str:
        """TensorFlow's name for device ``name``, e.g. ``/GPU:0`` for ``cuda:0``."""
        kind, index = device_index(_checked(self, name))
        return f"/{'GPU' if kind == 'cuda' else kind.upper()}:{index}"

    def to_tensor(self, a: np.ndarray, device: str = "cpu") -> Any:
        import tensorflow as tf

        with tf.device(self.device(device)):
            return tf.cast(tf.constant(_half_safe(a)), a.dtype.name)

    def to_numpy(self, t: Any) -> np.ndarray:
        import tensorflow as tf

        return _as(tf.cast(t, tf.float32 if t.dtype.size == 2 else t.dtype).numpy(), t.dtype.name)

    def forward(
        self,
        fn: FrameworkFn,
        x: np.ndarray,
        scale: np.ndarray | None,
        bias: np.ndarray | None,
        device: str,
    ) -> np.ndarray:
        import tensorflow as tf

        with tf.device(self.device(device)):
            inputs = [None if a is None else self.to_tensor(a, device) for a in (x, scale, bias)]
            return self.to_numpy(fn(*inputs))

    def vjp(
        self,
        fn: FrameworkFn,
        x: np.ndarray,
        dy: np.ndarray,
        scale: np.ndarray | None,
        bias: np.ndarray | None,
        device: str,
    ) -> Outputs:
        import tensorflow as tf

        with tf.device(self.device(device)):
            inputs = [None if a is None else self.to_tensor(a, device) for a in (x, scale, bias)]
            with tf.GradientTape() as tape:
                for t in inputs:
                    if t is not None:
                        tape.watch(t)
                y = fn(*inputs)
            watched = [t for t in inputs if t is not None]
            cotangent = tf.cast(self.to_tensor(dy, device), y.dtype)
            found = iter(tape.gradient(y, watched, output_gradients=cotangent))
            dx, dscale, dbias = (None if t is None else self.to_numpy(next(found)) for t in inputs)
            assert dx is not None
            return self.to_numpy(y), dx, dscale, dbias
