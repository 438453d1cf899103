"""Testing helpers for people's own norm implementations: `assert_conforms`, for any pytest suite.

    from normkit import NormSpec
    from normkit.testing import assert_conforms

    def test_my_rmsnorm():
        assert_conforms(my_rms_norm, NormSpec("rms", eps=1e-5), backend="torch")
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from normkit import reference
from normkit.backends import bridge as get_bridge
from normkit.conformance.cases import Case
from normkit.conformance.compare import (
    FORWARD_QUANTITIES,
    Inputs,
    compare,
    expected,
    quantities,
)
from normkit.dtypes import DTYPE_NAMES, is_half, round_to
from normkit.identify.forward import (
    HALF_PROBE_ELEMENTS,
    MIN_CAST_ELEMENTS,
    near_tie,
    representable,
)
from normkit.spec import NormSpec

__all__ = ["assert_conforms"]

_ARRAY_TYPES = {"torch": "torch.Tensor", "jax": "jax.Array", "tf": "tf.Tensor"}
_MAX_CAST_PROBE_CALLS = 64
_CAST_PROBE_SEED = 17  # added to the case seed: the cast probe draws inputs of its own


def assert_conforms(
    fn: Callable[..., Any],
    spec: NormSpec,
    *,
    backend: str,
    dtypes: Sequence[str] = ("float32", "float16", "bfloat16"),
    shapes: Sequence[tuple[int, ...]] = ((5, 7), (4, 256)),
    grad: bool = True,
    params: bool = False,
    param_dtype: str = "float32",
    device: str = "cpu",
) -> None:
    """Raise AssertionError unless ``fn`` computes ``spec`` within `normkit.tolerances`.

    Args:
      fn: a function of the framework ``backend``: ``fn(x) -> y``, or ``fn(x, scale, bias) -> y``
        with ``params=True`` (``scale``/``bias`` None where the spec has none). Without params
        the reference uses their initial values (an effective scale of 1, a zero bias). For a
        spec with a ``residual``: ``fn(x, residual) -> (y, h)``, or ``fn(x, residual, scale,
        bias) -> (y, h)``. For DyT with ``params=True`` the learned scalar comes last:
        ``fn(x, scale, bias, alpha)`` (``alpha`` of shape ``(1,)``); without params ``fn`` uses
        its own initial ``alpha``, ``spec.alpha_init``.
      spec: the norm ``fn`` should compute. Its ``backward`` says which gradients: ``"exact"``
        (the exact VJP rounded once: is it as accurate as it can be) or ``"autograd"`` (what
        autograd computes through the eager half-precision forward: does it train exactly like
        Hugging Face's Llama).
      backend: ``"torch"``, ``"jax"`` or ``"tf"`` (TensorFlow, eager).
      dtypes: input dtype names to check (float32, float64, float16, bfloat16); half inputs
        follow the spec's cast policy.
      shapes: input shapes; ``spec.axis`` picks the normalized axes.
      grad: also check the gradients (input, residual, and the params with ``params=True``).
      params: whether ``fn`` takes ``scale`` and ``bias`` (and DyT's ``alpha``).
      param_dtype: the parameters' dtype name, or ``"input"`` for the input's (as a module
        moved to it with ``.to(dtype)``). Default float32.
      device: a device the framework sees, e.g. ``"cpu"`` or ``"cuda:0"``.

    The error message names the worst case (dtype, shape) and its figures: max abs, max rel and
    max ulp errors against the bound, and any dtype mismatch. An output that is not an array of
    ``backend`` (None, a numpy array; for a residual spec, not a pair of them), has the wrong
    shape, or (with ``grad``) no gradient path to the input fails with a message naming that
    problem.

    Cast order. With ``params=True`` and a spec with a scale or a bias, each half dtype is also
    probed with parameters exactly representable in it, where ``"before_scale"`` (``y_hat``
    rounded before the affine step) and ``"after_scale"`` predict different outputs on many
    elements: as in `normkit.conformance.identify`, each of those elements counts for the order
    whose prediction the output is closer to, and ``fn`` fails when the other order gets more of
    them than the spec's, with both shares in the message. Without ``params`` the parameters
    are at their initial values, where both orders round ``y_hat`` once and agree: the cast
    order is not checked, and a spec claiming ``cast="before_scale"`` with half dtypes gets a
    warning saying so.

    Raises:
      AssertionError: ``fn`` does not conform.
      TypeError: ``spec`` is not a `NormSpec`.
      ValueError: empty ``dtypes`` or ``shapes``, an unknown dtype name, a shape the spec's axes
        do not fit, or an unknown backend.
    """
    names, sizes = _checked_arguments(spec, dtypes, shapes)
    if param_dtype != "input" and param_dtype not in DTYPE_NAMES:
        raise ValueError(
            f"param_dtype={param_dtype!r} is invalid: expected 'input' or one of "
            f"{', '.join(DTYPE_NAMES)}"
        )
    bridge = get_bridge(backend)
    halves = [d for d in names if is_half(DTYPE_NAMES[d])]
    affine = spec.scale or spec.bias
    if halves and affine and not params and spec.cast == "before_scale":
        warnings.warn(
            f"{_fn_name(fn)}: cast='before_scale' is not checked: without params=True the "
            "parameters are at their initial values (effective scale 1, zero bias), where both "
            "cast orders round y_hat once and give the same output; pass params=True to check it",
            UserWarning,
            stacklevel=2,
        )
    checked_names = _checked_quantities(spec, grad, params)
    failures: list[tuple[float, str]] = []
    for dtype in names:
        for shape in sizes:
            case = Case(spec, shape, dtype, dtype if param_dtype == "input" else param_dtype)
            label = f"{dtype}{list(shape)}"
            inputs = case.arrays()
            if not params:
                inputs = inputs._replace(scale=None, bias=None, alpha=None)
            checked = _CheckedFn(fn, backend, spec, params, grad, label)
            outputs = _run(bridge, checked, inputs, grad, device)
            problems, measured = compare(spec, inputs, outputs, checked_names)
            if problems:
                worst = max((m.error / m.bound.value for m in measured.values()), default=math.inf)
                structural = any("dtype" in p for p in problems)
                if grad and _zero_gradient(outputs[1], spec, inputs):
                    problems.append(
                        "dx is zero everywhere, the reference's is not: no gradient reaches x "
                        "(a stop_gradient or detach in fn?)"
                    )
                    structural = True
                text = f"{label}: " + "; ".join(problems)
                failures.append((math.inf if structural else worst, text))
    cast_findings = []
    if params and affine:
        largest = max(sizes, key=math.prod)
        for dtype in halves:
            label = f"{dtype}{list(largest)}"
            checked = _CheckedFn(fn, backend, spec, params, False, label)
            problem = _cast_order_problem(bridge, checked, spec, dtype, largest, device)
            if problem:
                cast_findings.append(f"{label}: {problem}")
    if failures or cast_findings:
        failures.sort(key=lambda f: -f[0])
        count = len(failures) + len(cast_findings)
        lines = [f"{_fn_name(fn)} does not conform to {spec} in {count} case(s); worst first:"]
        lines += [f"  {text}" for _, text in failures[:3]]
        lines += [f"  {text}" for text in cast_findings]
        raise AssertionError("\n".join(lines))


def _checked_quantities(spec: NormSpec, grad: bool, params: bool) -> tuple[str, ...]:
    """What is compared: the outputs (``y``, and ``h`` with a residual), with ``grad`` the
    gradients of the arrays ``fn`` is given."""
    names = quantities(spec)
    if not grad:
        return tuple(q for q in names if q in FORWARD_QUANTITIES)
    if params:
        return names
    return tuple(q for q in names if q in ("y", "dx", "h", "dresidual"))


def _checked_arguments(
    spec: object, dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]]
) -> tuple[list[str], list[tuple[int, ...]]]:
    """The dtype names and shapes to check; TypeError/ValueError naming what is wrong."""
    if not isinstance(spec, NormSpec):
        raise TypeError(
            f"spec must be a normkit.NormSpec, got {type(spec).__name__} {spec!r}; "
            "e.g. NormSpec('rms', eps=1e-5)"
        )
    allowed = ", ".join(DTYPE_NAMES)
    if isinstance(dtypes, str) or not isinstance(dtypes, Sequence):
        raise TypeError(f"dtypes must be a sequence of dtype names ({allowed}), got {dtypes!r}")
    if not dtypes:
        raise ValueError(f"dtypes is empty: nothing would be checked; give some of {allowed}")
    names = []
    for dtype in dtypes:
        name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
        if name not in DTYPE_NAMES:
            raise ValueError(
                f"dtypes: {dtype!r} is not a dtype normkit checks; expected one of {allowed}"
            )
        names.append(name)
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence):
        raise TypeError(f"shapes must be a sequence of shapes, e.g. ((5, 7),), got {shapes!r}")
    if not shapes:
        raise ValueError("shapes is empty: nothing would be checked; give shapes, e.g. ((5, 7),)")
    sizes = []
    for shape in shapes:
        if not isinstance(shape, Sequence) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in shape
        ):
            raise ValueError(
                f"shapes: {shape!r} is not a shape of positive sizes (shapes is a sequence of "
                "shapes, e.g. ((5, 7),), not one shape)"
            )
        spec.resolve_axes(len(shape))  # a ValueError naming the axis if it does not fit
        sizes.append(tuple(int(d) for d in shape))
    return names, sizes


class _CheckedFn:
    """``fn`` as the bridges call it, ``(x, scale, bias) -> y``, refusing outputs that are not
    one of the framework's arrays of the input's shape (or, for gradients in torch, detached
    ones) with an AssertionError. ``returned`` records that ``fn`` itself returned, so a later
    framework error is the backward's.

    The bridges' forward takes one input, two parameters and one output, and the VJP is called
    the same way; `pack` fits the extended calls into them: a residual spec's ``x`` and ``residual`` travel stacked (``fn`` gets the two
    halves), its ``(y, h)`` come back stacked in their promoted dtype (each cotangent is exact
    in it; `unpack` restores their own dtypes, recorded in ``out_dtypes``), and DyT's ``alpha``
    travels after the scale's elements.
    """

    def __init__(
        self, fn: Callable[..., Any], backend: str, spec: NormSpec, params: bool, grad: bool,
        label: str,
    ):
        self.fn = fn
        self.backend = backend
        self.residual = spec.residual is not None
        self.alpha = params and spec.kind == "dyt"
        self.spec = spec
        self.params = params
        self.grad = grad
        self.label = label
        self.returned = False
        self.out_dtypes: tuple[np.dtype, ...] = ()

    def pack(
        self, inputs: Inputs
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """``(x, dy, scale, bias)`` for a bridge, from the case's inputs."""
        x, dy, scale, bias, residual, dh, alpha = inputs[:7]
        if self.residual:
            assert residual is not None and dh is not None
            x = np.stack([x, residual])
            dy = np.stack([dy.astype(dh.dtype), dh])  # dh's dtype holds dy's values exactly
        if self.alpha:
            assert alpha is not None
            scale = alpha if scale is None else np.concatenate([scale.ravel(), alpha])
        return x, dy, scale, bias

    def unpack(
        self, y: np.ndarray, dx: np.ndarray | None, dscale: np.ndarray | None,
        dbias: np.ndarray | None, inputs: Inputs,
    ) -> dict[str, np.ndarray | None]:
        """The bridge's results as the quantities of the spec."""
        found: dict[str, np.ndarray | None] = {"y": y, "dx": dx, "dscale": dscale, "dbias": dbias}
        if self.residual:
            found["y"], found["h"] = (y[i].astype(d) for i, d in enumerate(self.out_dtypes))
            found["dx"], found["dresidual"] = (None, None) if dx is None else (dx[0], dx[1])
        if self.alpha:
            size = 0 if inputs.scale is None else inputs.scale.size
            found["dalpha"] = None if dscale is None else dscale[size:]
            found["dscale"] = None
            if dscale is not None and inputs.scale is not None:
                found["dscale"] = dscale[:size].reshape(inputs.scale.shape)
        return found

    def __call__(self, x: Any, scale: Any = None, bias: Any = None) -> Any:
        args = [x[0], x[1]] if self.residual else [x]
        if self.params:
            if self.alpha:
                shape = self.spec.param_shape(tuple(args[0].shape))
                alpha = scale[-1:]
                scale = _reshape(scale[:-1], shape, self.backend) if self.spec.scale else None
                args += [scale, bias, alpha]
            else:
                args += [scale, bias]
        out = self.fn(*args)
        self.returned = True
        where = f"{_fn_name(self.fn)} ({self.label})"
        if not self.residual:
            return self._checked(out, tuple(args[0].shape), where, "")
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            kind = "None" if out is None else f"a {type(out).__module__}.{type(out).__qualname__}"
            raise AssertionError(
                f"{where} returned {kind}; with residual={self.spec.residual!r} it must return "
                f"(y, h), two {_ARRAY_TYPES[self.backend]}s of the input's shape"
            )
        shape = tuple(args[0].shape)
        y, h = (self._checked(o, shape, where, f"{q} ") for o, q in zip(out, "yh", strict=True))
        self.out_dtypes = (_numpy_dtype(y, where), _numpy_dtype(h, where))
        return _stack(y, h, self.backend)

    def _checked(self, y: Any, shape: tuple[int, ...], where: str, what: str) -> Any:
        if not _is_framework_array(y, self.backend):
            kind = "None" if y is None else f"a {type(y).__module__}.{type(y).__qualname__}"
            raise AssertionError(
                f"{where} returned {what}{kind}; it must return a {_ARRAY_TYPES[self.backend]} "
                "of the input's shape"
            )
        if tuple(y.shape) != shape:
            raise AssertionError(
                f"{where} returned {what}shape {tuple(y.shape)} for an input of shape {shape}; "
                "a norm keeps the input's shape"
            )
        if self.grad and self.backend == "torch" and not y.requires_grad:
            raise AssertionError(
                f"{where} returned {what}an output detached from its inputs (requires_grad is "
                "False: a .detach(), a numpy round trip or torch.no_grad?), so no gradient can be "
                "checked; pass grad=False to check the forward only"
            )
        return y


def _is_framework_array(y: Any, backend: str) -> bool:
    if backend == "torch":
        import torch

        return isinstance(y, torch.Tensor)
    if backend == "jax":
        import jax

        return isinstance(y, jax.Array)
    import tensorflow as tf

    return bool(tf.is_tensor(y))


def _numpy_dtype(t: Any, where: str) -> np.dtype:
    """A framework array's dtype as numpy's; AssertionError if normkit has no such float."""
    name = str(getattr(t.dtype, "name", t.dtype)).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise AssertionError(f"{where} returned an array of dtype {name}, not a float dtype")
    return DTYPE_NAMES[name]


def _reshape(t: Any, shape: tuple[int, ...], backend: str) -> Any:
    if backend == "tf":
        import tensorflow as tf

        return tf.reshape(t, shape)
    return t.reshape(shape)


def _stack(y: Any, h: Any, backend: str) -> Any:
    """``y`` and ``h`` stacked in their promoted dtype (the widest; two halves give float32)."""
    if backend == "torch":
        import torch

        kind = torch.promote_types(y.dtype, h.dtype)
        return torch.stack([y.to(kind), h.to(kind)])
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.stack([y, h])
    import tensorflow as tf

    if y.dtype != h.dtype:
        wide = tf.float64 if tf.float64 in (y.dtype, h.dtype) else tf.float32
        y, h = tf.cast(y, wide), tf.cast(h, wide)
    return tf.stack([y, h])


def _no_gradient(checked: _CheckedFn, why: str) -> AssertionError:
    return AssertionError(
        f"{_fn_name(checked.fn)} ({checked.label}): no gradient could be taken through its "
        f"output ({why}); y must be computed from x (and scale, bias) by differentiable "
        f"{checked.backend} operations, with no detach, numpy round trip or stop_gradient; pass "
        "grad=False to check the forward only"
    )


def _run(
    bridge: Any, checked: _CheckedFn, inputs: Inputs, grad: bool, device: str
) -> tuple[np.ndarray | None, ...]:
    """The quantities of ``checked.spec`` through the bridge (without ``grad``, the outputs and
    None for the gradients); a framework error after ``fn`` returned (its backward, or reading
    its gradients) becomes an AssertionError naming it."""
    x, dy, scale, bias = checked.pack(inputs)
    if not grad:
        found = checked.unpack(bridge.forward(checked, x, scale, bias, device), None, None, None,
                               inputs)
        return tuple(found.get(q) for q in quantities(checked.spec))
    params = {name: p for name, p in (("scale", scale), ("bias", bias)) if p is not None}
    try:
        (y,), (dx,), dparams = bridge.vjp(checked, (x,), (dy,), params, device)
    except AssertionError:
        raise
    except Exception as err:
        first_line = (str(err).splitlines() or [""])[0]
        name = f"{_fn_name(checked.fn)} ({checked.label})"
        if not checked.returned and _is_jax_conversion_error(err):
            raise AssertionError(
                f"{name} converted its traced input to numpy or a "
                f"Python value ({type(err).__name__}: {first_line}); the gradient is taken "
                "with jax.vjp, so fn must compute y with jax operations and return a jax.Array; "
                "pass grad=False to check the forward only"
            ) from err
        if not checked.returned:
            raise  # fn's own error, with its own traceback
        raise _no_gradient(checked, f"{type(err).__name__}: {first_line}") from err
    if dx is None:  # the framework found no path from y back to x
        raise _no_gradient(checked, "none reaches x")
    found = checked.unpack(y, dx, dparams.get("scale"), dparams.get("bias"), inputs)
    return tuple(found.get(q) for q in quantities(checked.spec))


def _is_jax_conversion_error(err: Exception) -> bool:
    """Whether ``err`` is jax's refusal to turn a traced array into numpy or a Python value."""
    errors = getattr(sys.modules.get("jax"), "errors", None)
    conversions = tuple(
        getattr(errors, name)
        for name in ("TracerArrayConversionError", "ConcretizationTypeError")
        if hasattr(errors, name)
    )
    return bool(conversions) and isinstance(err, conversions)


def _zero_gradient(dx: np.ndarray | None, spec: NormSpec, inputs: Inputs) -> bool:
    """Whether ``dx`` is all zeros while the reference's input gradient is not."""
    x = inputs.x
    if dx is None or np.asarray(dx).shape != x.shape or np.any(np.asarray(dx) != 0):
        return False
    return bool(np.any(expected(spec, inputs)["dx"] != 0))


def _cast_order_problem(
    bridge: Any,
    checked: _CheckedFn,
    spec: NormSpec,
    dtype: str,
    shape: tuple[int, ...],
    device: str,
) -> str | None:
    """Which cast order ``fn``'s ``dtype`` outputs follow, when it is not ``spec.cast``.

    Inputs of ``shape`` (calls enough for about 4096 elements) with ``w`` and ``b`` exact in
    both half dtypes; per element, the order whose prediction the output is closer to, counted
    where the two predictions differ and neither lies near a rounding midpoint (as identify
    does). None when the spec's order gets at least as many as the other, or when the output
    dtype is not the input's (reported by the forward check) or too few elements differ.
    """
    half = DTYPE_NAMES[dtype]
    seed = int(Case(spec, shape, dtype).id, 16) + _CAST_PROBE_SEED
    rng = np.random.default_rng(seed)
    param_shape = spec.param_shape(shape)
    n_params = math.prod(param_shape)
    calls = min(_MAX_CAST_PROBE_CALLS, -(-HALF_PROBE_ELEMENTS // math.prod(shape)))
    broadcast = [shape[i] if i in spec.resolve_axes(len(shape)) else 1 for i in range(len(shape))]
    counts = {"after_scale": 0, "before_scale": 0}
    differing = 0
    bare = spec.replace(
        scale=False, bias=False, scale_offset=0.0, offset_dtype="float32", residual=None,
        output_dtype="input",
    )
    for _ in range(calls):
        signs = rng.choice([-1.0, 1.0], shape)
        x = round_to(signs * rng.uniform(0.5, 1.5, shape), half)
        w = representable(rng, n_params, 1.0).reshape(param_shape) if spec.scale else None
        b = representable(rng, n_params, 0.25).reshape(param_shape) if spec.bias else None
        zeros = np.zeros_like(x) if spec.residual is not None else None  # h = x
        alpha = np.array([spec.alpha_init], np.float32) if spec.kind == "dyt" else None
        probe = Inputs(x, x, w, b, zeros, zeros, alpha)
        out = _run(bridge, checked, probe, False, device)[0]
        if out is None or out.dtype != half:
            return None
        x64 = x.astype(np.float64)
        y_hat = reference.normalize(x64, bare)
        g, shift = reference.check_params(shape, spec, w, b)
        g, shift = g.reshape(broadcast), shift.reshape(broadcast)
        exact = {
            "after_scale": y_hat * g + shift,
            "before_scale": round_to(y_hat, half).astype(np.float64) * g + shift,
        }
        ties = near_tie(y_hat, half) | near_tie(exact["after_scale"], half)
        ties |= near_tie(exact["before_scale"], half)
        predicted = {c: round_to(v, half).astype(np.float64) for c, v in exact.items()}
        differ = (predicted["after_scale"] != predicted["before_scale"]) & ~ties
        y = out.astype(np.float64)
        distance = {c: np.abs(y - v) for c, v in predicted.items()}
        counts["after_scale"] += int(
            np.count_nonzero((distance["after_scale"] < distance["before_scale"])[differ])
        )
        counts["before_scale"] += int(
            np.count_nonzero((distance["before_scale"] < distance["after_scale"])[differ])
        )
        differing += int(np.count_nonzero(differ))
    if differing < MIN_CAST_ELEMENTS:
        return None
    share = {c: count / differing for c, count in counts.items()}
    other = "after_scale" if spec.cast == "before_scale" else "before_scale"
    if share[other] <= share[spec.cast]:
        return None
    return (
        f"cast order: the spec says {spec.cast}, but the outputs are closer to {other} on "
        f"{share[other]:.0%} and to {spec.cast} on {share[spec.cast]:.0%} of the {differing} "
        f"elements where the two orders round differently (parameters exact in {dtype})"
    )


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
