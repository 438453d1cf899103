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
from normkit.conformance.compare import Inputs, compare
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
    device: str = "cpu",
) -> None:
    """Raise AssertionError unless ``fn`` computes ``spec`` within `normkit.tolerances`.

    Args:
      fn: a function of the framework ``backend``: ``fn(x) -> y``, or ``fn(x, scale, bias) -> y``
        with ``params=True`` (``scale``/``bias`` None where the spec has none). Without params
        the reference uses their initial values (an effective scale of 1, a zero bias).
      spec: the norm ``fn`` should compute.
      backend: ``"torch"``, ``"jax"`` or ``"tf"`` (TensorFlow, eager).
      dtypes: input dtype names to check (float32, float64, float16, bfloat16); half inputs
        follow the spec's cast policy.
      shapes: input shapes; ``spec.axis`` picks the normalized axes.
      grad: also check the gradients (input, and the params with ``params=True``).
      params: whether ``fn`` takes ``scale`` and ``bias``.
      device: a device the framework sees, e.g. ``"cpu"`` or ``"cuda:0"``.

    The error message names the worst case (dtype, shape) and its figures: max abs, max rel and
    max ulp errors against the bound, and any dtype mismatch. An output that is not an array of
    ``backend`` (None, a numpy array), has the wrong shape, or (with ``grad``) no gradient path to
    the input fails with a message naming that problem.

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
    quantities: tuple[str, ...] = ("y", "dx", "dscale", "dbias") if params else ("y", "dx")
    if not grad:
        quantities = ("y",)
    failures: list[tuple[float, str]] = []
    for dtype in names:
        for shape in sizes:
            case = Case(spec, shape, dtype)
            label = f"{dtype}{list(shape)}"
            x, dy, scale, bias = case.inputs()
            if not params:
                scale = bias = None
            checked = _CheckedFn(fn, backend, params, grad, label)
            outputs = _run(bridge, checked, (x, dy, scale, bias), grad, device, label, backend)
            arrays = Inputs(x, dy, scale, bias)
            problems, measured = compare(spec, arrays, outputs, quantities)  # type: ignore[arg-type]
            if problems:
                worst = max((m.error / m.bound.value for m in measured.values()), default=math.inf)
                structural = any("dtype" in p for p in problems)
                if grad and _zero_gradient(outputs[1], x, dy, spec, scale, bias):
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
            checked = _CheckedFn(fn, backend, params, False, label)
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
    """``fn`` as the bridges call it, refusing outputs that are not one of the framework's arrays
    of the input's shape (or, for gradients in torch, detached ones) with an AssertionError.
    ``returned`` records that ``fn`` itself returned, so a later framework error is the
    backward's."""

    def __init__(self, fn: Callable[..., Any], backend: str, params: bool, grad: bool, label: str):
        self.fn = fn
        self.backend = backend
        self.params = params
        self.grad = grad
        self.label = label
        self.returned = False

    def __call__(self, x: Any, scale: Any, bias: Any) -> Any:
        y = self.fn(x, scale, bias) if self.params else self.fn(x)
        self.returned = True
        where = f"{_fn_name(self.fn)} ({self.label})"
        if not _is_framework_array(y, self.backend):
            kind = "None" if y is None else f"a {type(y).__module__}.{type(y).__qualname__}"
            raise AssertionError(
                f"{where} returned {kind}; it must return a {_ARRAY_TYPES[self.backend]} of "
                "the input's shape"
            )
        if tuple(y.shape) != tuple(x.shape):
            raise AssertionError(
                f"{where} returned shape {tuple(y.shape)} for an input of shape {tuple(x.shape)}; "
                "a norm keeps the input's shape"
            )
        if self.grad and self.backend == "torch" and not y.requires_grad:
            raise AssertionError(
                f"{where} returned an output detached from its inputs (requires_grad is False: "
                "a .detach(), a numpy round trip or torch.no_grad?), so no gradient can be "
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


def _run(
    bridge: Any,
    checked: _CheckedFn,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None],
    grad: bool,
    device: str,
    label: str,
    backend: str,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """``(y, dx, dscale, dbias)`` through the bridge; a framework error after ``fn`` returned
    (its backward, or reading its gradients) becomes an AssertionError naming it."""
    x, dy, scale, bias = arrays
    if not grad:
        return bridge.forward(checked, x, scale, bias, device), None, None, None
    try:
        return bridge.vjp(checked, x, dy, scale, bias, device)  # type: ignore[no-any-return]
    except AssertionError:
        raise
    except Exception as err:
        first_line = (str(err).splitlines() or [""])[0]
        if not checked.returned and _is_jax_conversion_error(err):
            raise AssertionError(
                f"{_fn_name(checked.fn)} ({label}) converted its traced input to numpy or a "
                f"Python value ({type(err).__name__}: {first_line}); the gradient is taken "
                "with jax.vjp, so fn must compute y with jax operations and return a jax.Array; "
                "pass grad=False to check the forward only"
            ) from err
        if not checked.returned:
            raise  # fn's own error, with its own traceback
        raise AssertionError(
            f"{_fn_name(checked.fn)} ({label}): no gradient could be taken through its output "
            f"({type(err).__name__}: {first_line}); y must be computed from x (and scale, bias) "
            f"by differentiable {backend} operations, with no detach, numpy round trip or "
            "stop_gradient; pass grad=False to check the forward only"
        ) from err


def _is_jax_conversion_error(err: Exception) -> bool:
    """Whether ``err`` is jax's refusal to turn a traced array into numpy or a Python value."""
    errors = getattr(sys.modules.get("jax"), "errors", None)
    conversions = tuple(
        getattr(errors, name)
        for name in ("TracerArrayConversionError", "ConcretizationTypeError")
        if hasattr(errors, name)
    )
    return bool(conversions) and isinstance(err, conversions)


def _zero_gradient(
    dx: np.ndarray | None,
    x: np.ndarray,
    dy: np.ndarray,
    spec: NormSpec,
    scale: np.ndarray | None,
    bias: np.ndarray | None,
) -> bool:
    """Whether ``dx`` is all zeros while the reference's input gradient is not."""
    if dx is None or np.asarray(dx).shape != x.shape or np.any(np.asarray(dx) != 0):
        return False
    expected = reference.normalize_vjp(x, dy, spec, scale, bias)[0]
    return bool(np.any(expected != 0))


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
    for _ in range(calls):
        signs = rng.choice([-1.0, 1.0], shape)
        x = round_to(signs * rng.uniform(0.5, 1.5, shape), half)
        w = representable(rng, n_params, 1.0).reshape(param_shape) if spec.scale else None
        b = representable(rng, n_params, 0.25).reshape(param_shape) if spec.bias else None
        out = bridge.forward(checked, x, w, b, device)
        if out.dtype != half:
            return None
        x64 = x.astype(np.float64)
        y_hat = reference.normalize(x64, spec.replace(scale=False, bias=False, scale_offset=0.0))
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
