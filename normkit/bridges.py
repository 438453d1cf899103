"""The seam between the harness and a framework: the `Bridge` protocol, normkit's device names,
and one bridge per framework (numpy <-> tensors, devices, forward and VJP).

Each class imports its framework inside its methods, so this module imports none; use
`normkit.backends.bridge` to get one. Devices take normkit's names (``cpu``, ``cuda:N`` with
``gpu:N`` accepted, ``tpu:N``, ``mps``); a device the framework does not see is a ValueError.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from normkit import dtypes

__all__ = [
    "Bridge", "FrameworkFn", "JaxBridge", "TensorFlowBridge", "TorchBridge", "VjpFn",
    "VjpResult", "device_index", "device_name",
]

FrameworkFn = Callable[[Any, Any, Any], Any]
"""``fn(x, scale, bias) -> y`` on a framework's tensors (``scale``/``bias`` None when absent)."""
VjpFn = Callable[..., Any]
"""``fn(*primals, **params) -> output`` or a tuple of outputs, on a framework's tensors: the
primals are the inputs (``x``, then a residual, ...), the params the named parameters."""
VjpResult = tuple[
    tuple[np.ndarray, ...], tuple[np.ndarray | None, ...], dict[str, np.ndarray | None]
]
"""``(outputs, dprimals, dparams)`` as numpy arrays: one per output, per primal and per
parameter (by name); None where the framework gives no gradient (``fn`` ignores that input)."""

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
        self, fn: VjpFn, primals: Sequence[np.ndarray], cotangents: Sequence[np.ndarray],
        params: Mapping[str, np.ndarray], device: str = "cpu", *, jit: bool = False,
    ) -> VjpResult:
        """The outputs of ``fn(*primals, **params)`` and the gradients of
        ``sum_i <output_i, cotangents[i]>`` by each primal and each parameter.

        ``fn`` returns one tensor or a tuple of them, one cotangent each (cast to its output's
        dtype). ``jit`` compiles the forward and backward as one program (`jax.jit`,
        ``tf.function(jit_compile=True)``); torch compiles ``fn`` itself (``torch.compile``),
        so `TorchBridge` refuses it.
        """
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

    def forward(
        self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None,
        bias: np.ndarray | None, device: str,
    ) -> np.ndarray:
        import torch

        place = _checked(self, device)
        with torch.no_grad():
            inputs = (None if a is None else self.to_tensor(a, place) for a in (x, scale, bias))
            return self.to_numpy(fn(*inputs))

    def vjp(
        self, fn: VjpFn, primals: Sequence[np.ndarray], cotangents: Sequence[np.ndarray],
        params: Mapping[str, np.ndarray], device: str = "cpu", *, jit: bool = False,
    ) -> VjpResult:
        import torch

        if jit:
            raise ValueError("torch has no jit here: compile fn with torch.compile and pass it")
        place = _checked(self, device)
        inputs = [self.to_tensor(a, place).requires_grad_(True) for a in primals]
        weights = {k: self.to_tensor(a, place).requires_grad_(True) for k, a in params.items()}
        outputs = _outputs(fn(*inputs, **weights), cotangents)
        pairs = zip(cotangents, outputs, strict=True)
        cast = [self.to_tensor(c, place).to(o.dtype) for c, o in pairs]
        torch.autograd.backward(list(outputs), cast)

        def grad(t: Any) -> np.ndarray | None:
            return None if t.grad is None else self.to_numpy(t.grad)

        return (
            tuple(self.to_numpy(o) for o in outputs),
            tuple(grad(t) for t in inputs),
            {k: grad(t) for k, t in weights.items()},
        )


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

    def float64_scope(self, *kinds: Any) -> contextlib.AbstractContextManager[Any]:
        """JAX's 64-bit mode, scoped, when one of the dtypes ``kinds`` is float64 (without it
        JAX computes float64 arrays in float32); else nothing."""
        import jax

        if not any(np.dtype(kind) == np.float64 for kind in kinds):
            return contextlib.nullcontext()
        return jax.enable_x64(True)

    def forward(
        self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None,
        bias: np.ndarray | None, device: str,
    ) -> np.ndarray:
        return self.to_numpy(
            fn(*(None if a is None else self.to_tensor(a, device) for a in (x, scale, bias)))
        )

    def vjp(
        self, fn: VjpFn, primals: Sequence[np.ndarray], cotangents: Sequence[np.ndarray],
        params: Mapping[str, np.ndarray], device: str = "cpu", *, jit: bool = False,
    ) -> VjpResult:
        import jax

        arrays = (tuple(primals), dict(params), tuple(cotangents))
        with self.float64_scope(*(np.asarray(a).dtype for a in jax.tree.leaves(arrays))):
            run = _jax_program(fn, jit)
            outputs, dprimals, dparams = run(*jax.device_put(arrays, self.device(device)))
            return (
                tuple(self.to_numpy(o) for o in outputs),
                tuple(self.to_numpy(g) for g in dprimals),
                {k: self.to_numpy(g) for k, g in dparams.items()},
            )


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
        self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None,
        bias: np.ndarray | None, device: str,
    ) -> np.ndarray:
        import tensorflow as tf

        with tf.device(self.device(device)):
            inputs = [None if a is None else self.to_tensor(a, device) for a in (x, scale, bias)]
            return self.to_numpy(fn(*inputs))

    def vjp(
        self, fn: VjpFn, primals: Sequence[np.ndarray], cotangents: Sequence[np.ndarray],
        params: Mapping[str, np.ndarray], device: str = "cpu", *, jit: bool = False,
    ) -> VjpResult:
        import tensorflow as tf

        with tf.device(self.device(device)):
            outputs, dprimals, dparams = _tf_program(fn, jit)(
                [self.to_tensor(a, device) for a in primals],
                {k: self.to_tensor(a, device) for k, a in params.items()},
                [self.to_tensor(c, device) for c in cotangents],
            )
            return (
                tuple(self.to_numpy(o) for o in outputs),
                tuple(None if g is None else self.to_numpy(g) for g in dprimals),
                {k: None if g is None else self.to_numpy(g) for k, g in dparams.items()},
            )


@functools.lru_cache(maxsize=64)
def _jax_program(fn: VjpFn, jit: bool) -> Callable[..., Any]:
    """``(primals, params, cotangents) -> (outputs, dprimals, dparams)`` of ``fn``, one per
    function (the 64 latest): jitted, it is traced and compiled once per input signature."""
    import jax

    def program(primals: Any, params: Any, cotangents: Any) -> Any:
        outputs, pullback = jax.vjp(
            lambda p, q: _outputs(fn(*p, **q), cotangents), primals, params
        )
        cast = tuple(c.astype(o.dtype) for c, o in zip(cotangents, outputs, strict=True))
        return (outputs, *pullback(cast))

    return jax.jit(program) if jit else program


@functools.lru_cache(maxsize=64)
def _tf_program(fn: VjpFn, jit: bool) -> Callable[..., Any]:
    """``(primals, params, cotangents) -> (outputs, dprimals, dparams)`` of ``fn`` under a
    gradient tape, one per function (the 64 latest): with ``jit`` a
    ``tf.function(jit_compile=True)``, traced and compiled once per input signature."""
    import tensorflow as tf

    def program(primals: Any, params: Any, cotangents: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch((primals, params))
            outputs = _outputs(fn(*primals, **params), cotangents)
        cast = [tf.cast(c, o.dtype) for c, o in zip(cotangents, outputs, strict=True)]
        return (outputs, *tape.gradient(outputs, (primals, params), output_gradients=cast))

    return tf.function(program, jit_compile=True) if jit else program


def _outputs(out: Any, cotangents: Sequence[Any]) -> tuple[Any, ...]:
    """``fn``'s result as a tuple of outputs; ValueError unless there is one cotangent each."""
    outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(outputs) != len(cotangents):
        raise ValueError(
            f"fn returned {len(outputs)} outputs but {len(cotangents)} cotangents were given"
        )
    return outputs
