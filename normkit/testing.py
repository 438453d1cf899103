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
from typing import Any, NamedTuple

import numpy as np

from normkit.backends import bridge as get_bridge
from normkit.conformance.cases import ROW_LABELS, Case
from normkit.conformance.compare import (
    FORWARD_QUANTITIES,
    Inputs,
    compare,
    expected,
    quantities,
)
from normkit.conformance.rows import applies
from normkit.dtypes import DTYPE_NAMES, is_half
from normkit.identify.forward import HALF_PROBE_ELEMENTS
from normkit.spec import NormSpec

__all__ = ["assert_conforms"]

_ARRAY_TYPES = {"torch": "torch.Tensor", "jax": "jax.Array", "tf": "tf.Tensor"}
_DEFAULT_SHAPES = ((5, 7), (4, 256))
_SHORT_ROWS = ((3, 1), (6, 2))  # rows of one and two elements: forward only
_MAX_TIE_ROWS = 1024
_PROBE_ROWS = 8


class _NotConforming(AssertionError):
    """A failure found by `assert_conforms` itself (not an assertion inside ``fn``): raised
    again from `assert_conforms`, so that the traceback ends at the caller's line."""


def assert_conforms(
    fn: Callable[..., Any],
    spec: NormSpec,
    *,
    backend: str,
    dtypes: Sequence[str] = ("float32", "float16", "bfloat16"),
    shapes: Sequence[tuple[int, ...]] | None = None,
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
        bias) -> (y, h)``. For a gated spec: ``fn(x, gate) -> y``, or ``fn(x, gate, scale,
        bias) -> y`` (``gate`` of x's shape and dtype; its gradient is checked as ``dgate``).
        For DyT with ``params=True`` the learned scalar comes last: ``fn(x, scale, bias,
        alpha)`` (``alpha`` of shape ``(1,)``); without params ``fn`` uses its own initial
        ``alpha``, ``spec.alpha_init``.
      spec: the norm ``fn`` should compute. Its ``backward`` says which gradients: ``"exact"``
        (the exact VJP rounded once: is it as accurate as it can be) or ``"autograd"`` (what
        autograd computes through the eager half-precision forward: does it train exactly like
        Hugging Face's Llama).
      backend: ``"torch"``, ``"jax"`` or ``"tf"`` (TensorFlow, eager).
      dtypes: input dtype names to check (float32, float64, float16, bfloat16); half inputs
        follow the spec's cast policy.
      shapes: input shapes; ``spec.axis`` picks the normalized axes. Default ``(5, 7)`` and
        ``(4, 256)`` (with ``group_size``, rows of whole groups).
      grad: also check the gradients (input, residual, gate, and the params with
        ``params=True``).
      params: whether ``fn`` takes ``scale`` and ``bias`` (and DyT's ``alpha``).
      param_dtype: the parameters' dtype name, or ``"input"`` for the input's (as a module
        moved to it with ``.to(dtype)``). Default float32.
      device: a device the framework sees, e.g. ``"cpu"`` or ``"cuda:0"``.

    The inputs, per dtype and shape (`normkit.conformance.rows`): unit-scale rows; rows whose
    statistic lies at eps and below it, for both placements (eps's value and placement set the
    output there); for LayerNorm, rows of a large mean (the variance algorithm; the relative
    bounds grow with the rows' condition ``max|x| / std(x)``); rows of one and two elements
    (forward only: there the exact gradient is of the order of eps, which any float32 backward
    loses to cancellation); and for half dtypes with ``params=True``, rows and parameters where
    the spec's roundings (cast order, offset dtype, rounding of a residual sum) predict outputs
    an ulp apart on many elements, each element counting for the one the output is closer to.

    The error message says first what ``fn`` most likely does differently, from
    `normkit.identify`'s reading of its forward (e.g. ``eps_placement='outside', not
    'inside'``), then the worst cases (dtype, shape, rows) with their figures: max abs, max rel
    and max ulp errors against the bound, and any dtype mismatch. An output that is not an array
    of ``backend`` (None, a numpy array; for a residual spec, not a pair of them), has the wrong
    shape, or (with ``grad``) no gradient path to the input fails with a message naming that
    problem.

    Without ``params`` the parameters are at their initial values, where both cast orders round
    ``y_hat`` once and agree: the cast order is not checked, and a spec claiming
    ``cast="before_scale"`` with half dtypes gets a warning saying so.

    Raises:
      AssertionError: ``fn`` does not conform.
      TypeError: ``spec`` is not a `NormSpec`.
      ValueError: empty ``dtypes`` or ``shapes``, an unknown dtype name, a shape the spec's axes
        or groups do not fit, or an unknown backend.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not normkit's
    try:
        _assert_conforms(fn, spec, backend, dtypes, shapes, grad, params, param_dtype, device)
    except _NotConforming as failure:
        raise AssertionError(str(failure)) from None


def _assert_conforms(
    fn: Callable[..., Any], spec: NormSpec, backend: str, dtypes: Sequence[str],
    shapes: Sequence[tuple[int, ...]] | None, grad: bool, params: bool, param_dtype: str,
    device: str,
) -> None:
    _check_spec(spec)
    names, sizes = _checked_arguments(spec, dtypes, _default_shapes(spec) if shapes is None
                                      else shapes)
    if param_dtype != "input" and param_dtype not in DTYPE_NAMES:
        raise ValueError(
            f"param_dtype={param_dtype!r} is invalid: expected 'input' or one of "
            f"{', '.join(DTYPE_NAMES)}"
        )
    get_bridge(backend)  # an unknown backend, or one not installed, before anything runs
    halves = [d for d in names if is_half(DTYPE_NAMES[d])]
    affine = spec.scale or spec.bias
    if halves and affine and not params and spec.cast == "before_scale":
        warnings.warn(
            f"{_fn_name(fn)}: cast='before_scale' is not checked: without params=True the "
            "parameters are at their initial values (effective scale 1, zero bias), where both "
            "cast orders round y_hat once and give the same output; pass params=True to check it",
            UserWarning,
            stacklevel=3,
        )
    failures = _failures(fn, spec, backend, names, sizes, grad, params, param_dtype, device)
    if failures:
        failing = {q for f in failures for q in f.quantities}
        shown = _worst_first([(f.worst, f.text) for f in failures])
        lines = [f"{_fn_name(fn)} does not conform to {spec!r} in {len(failures)} case(s)."]
        lines.append(
            _likely_difference(fn, spec, backend, params, param_dtype, device, names, sizes,
                               failing)
        )
        lines.append("Worst first:")
        lines += [f"  {text}" for text in shown]
        if len(failures) > len(shown):
            lines.append(f"  ... and {len(failures) - len(shown)} more")
        raise _NotConforming("\n".join(lines))


class _Failure(NamedTuple):
    """A case ``fn`` fails: its worst error as a fraction of the bound (infinite for a
    structural problem), the line that says so, its dtype and the failing quantities."""

    worst: float
    text: str
    dtype: str
    quantities: frozenset[str]


def _failures(
    fn: Callable[..., Any], spec: NormSpec, backend: str, names: list[str],
    sizes: list[tuple[int, ...]], grad: bool, params: bool, param_dtype: str, device: str,
) -> list[_Failure]:
    """Every case of `_cases` that ``fn`` fails, over the dtypes ``names``."""
    bridge = get_bridge(backend)
    ties = params and bool(spec.scale or spec.bias)
    found = []
    for dtype in names:
        own = dtype if param_dtype == "input" else param_dtype
        for case, with_grad in _cases(spec, dtype, own, sizes, grad, ties):
            checked = _CheckedFn(fn, backend, spec, params, with_grad, _label(case))
            failure = _check_case(bridge, checked, case, params, with_grad, device)
            if failure is not None:
                found.append(failure)
    return found


def _worst_first(failures: list[tuple[float, str]], count: int = 4) -> list[str]:
    """The lines to show: each dtype's worst case, then the next worst, ``count`` at least."""
    ordered = sorted(failures, key=lambda f: -f[0])
    dtypes_seen: set[str] = set()
    first = []
    for _, text in ordered:
        dtype = text.split("[")[0]
        if dtype not in dtypes_seen:
            dtypes_seen.add(dtype)
            first.append(text)
    rest = [text for _, text in ordered if text not in first]
    return first + rest[: max(0, count - len(first))]


def _default_shapes(spec: NormSpec) -> tuple[tuple[int, ...], ...]:
    """`_DEFAULT_SHAPES`, with ``group_size`` rows of whole groups (2 and 64 of them, or as
    many as make 256 elements)."""
    size = spec.group_size
    if size is None:
        return _DEFAULT_SHAPES
    return ((5, 2 * size), (4, size * max(1, 256 // size)))


def _cases(
    spec: NormSpec, dtype: str, param_dtype: str, sizes: list[tuple[int, ...]], grad: bool,
    ties: bool,
) -> list[tuple[Case, bool]]:
    """The cases of one dtype, each with whether its gradients are checked: per shape the
    standard rows, the rows near eps and the large-mean rows that apply (8 rows of the shape's
    normalized size where its axes allow); rows of one and two
    elements (forward only); with ``ties`` (params and an affine step), one case of rows near
    rounding ties (forward only) of about 4096 elements."""
    found = []
    for shape in sizes:
        n = math.prod(shape[a] for a in spec.resolve_axes(len(shape)))
        for rows in ("standard", "eps", "large_mean"):
            if applies(rows, spec, dtype, spec.group_size or n):
                # probe rows of their own need several rows: eps rows cycle through 7 sizes
                wide = shape if rows == "standard" else (
                    _rows_of(spec, shape, _PROBE_ROWS, spec.param_shape(shape)) or shape
                )
                found.append((Case(spec, wide, dtype, param_dtype, rows), grad))
    if spec.group_size is None:
        for short in _SHORT_ROWS:
            shape = _rows_of(spec, sizes[0], short[0], short[1:])
            if shape is not None:
                found.append((Case(spec, shape, dtype, param_dtype), False))
    if ties and applies("ties", spec, dtype, 1):
        largest = max(sizes, key=math.prod)
        n = math.prod(spec.param_shape(largest))
        rows = min(_MAX_TIE_ROWS, -(-HALF_PROBE_ELEMENTS // n))
        shape = _rows_of(spec, largest, rows, spec.param_shape(largest))
        if shape is not None:
            found.append((Case(spec, shape, dtype, param_dtype, "ties"), False))
    return found


def _rows_of(
    spec: NormSpec, like: tuple[int, ...], rows: int, normalized: tuple[int, ...]
) -> tuple[int, ...] | None:
    """A shape of ``rows`` rows of the ``normalized`` shape, of ``like``'s rank where its
    normalized axes are its trailing ones (one more axis in front where all are normalized and
    the spec counts them from the end); None where the axes allow neither."""
    rank = len(like)
    axes = spec.resolve_axes(rank)
    if axes != tuple(range(rank - len(axes), rank)):
        return None
    if len(normalized) != len(axes):  # a row of n elements over several axes: the last holds them
        normalized = (*([1] * (len(axes) - 1)), math.prod(normalized))
    if rank > len(axes):
        return (rows, *([1] * (rank - len(axes) - 1)), *normalized)
    if all(a < 0 for a in spec.axis):
        return (rows, *normalized)
    return None


def _label(case: Case) -> str:
    rows = "" if case.rows == "standard" else f" {ROW_LABELS[case.rows]}"
    return f"{case.dtype}{list(case.shape)}{rows}"


def _check_case(
    bridge: Any, checked: _CheckedFn, case: Case, params: bool, grad: bool, device: str
) -> _Failure | None:
    """The case's failure, or None."""
    inputs = case.arrays()
    if not params:
        inputs = inputs._replace(scale=None, bias=None, alpha=None)
    outputs = _run(bridge, checked, inputs, grad, device)
    names = _checked_quantities(case.spec, grad, params)
    problems, measured = compare(case.spec, inputs, outputs, names, case.rows)
    if not problems:
        return None
    failing = {q for q, m in measured.items() if not m.passed}
    worst = max((m.error / m.bound.value for m in measured.values()), default=math.inf)
    structural = any("dtype" in p for p in problems)
    if grad and _zero_gradient(outputs[1], case.spec, inputs):
        problems.append(
            "dx is zero everywhere, the reference's is not: no gradient reaches x "
            "(a stop_gradient or detach in fn?)"
        )
        structural = True
    if any(p.split(":")[0] in ("cast order", "offset dtype", "residual sum") for p in problems):
        failing.add("y")
    text = f"{checked.label}: " + "; ".join(problems)
    return _Failure(math.inf if structural else worst, text, case.dtype, frozenset(failing))


def _likely_difference(
    fn: Callable[..., Any], spec: NormSpec, backend: str, params: bool, param_dtype: str,
    device: str, names: list[str], sizes: list[tuple[int, ...]], failing: set[str],
) -> str:
    """What ``fn`` most likely does otherwise than ``spec``: the fields where
    `normkit.identify`'s reading of its forward differs from the spec (a field identify cannot
    see from a forward, or with the parameters fixed, is left out), or, where it finds none,
    which quantities fail."""
    from normkit.identify import identify, identify_gated
    from normkit.identify.differences import differences

    shape = spec.param_shape(max(sizes, key=math.prod))
    probed = [d for d in names if d in ("float32", "float64")] or ["float32"]
    probed += [d for d in names if is_half(DTYPE_NAMES[d])]
    ignore = ["backward", "residual"]
    if not spec.scale:  # fn is given no scale, and how it would apply one does not matter
        ignore += ["scale", "scale_offset", "offset_dtype"]
    if not spec.bias:
        ignore.append("bias")
    if param_dtype != "float32":  # identify reads these with float32 parameters
        ignore += ["output_dtype", "offset_dtype"]
    reader = identify_gated if spec.gate is not None else identify
    try:
        found = reader(_forward_only(fn, spec, backend, params, device), shape,
                       backend=backend, params=params, device=device, dtypes=probed)
    except Exception as err:  # fn is what it is: say what identify saw, never fail here
        first = (str(err).splitlines() or [""])[0]
        return f"Likely difference: identify cannot read {_fn_name(fn)} as a norm: {first}"
    lines = differences(found, spec, ignore)
    if lines:
        return f"Likely difference (identify's reading of {_fn_name(fn)}): " + "; ".join(lines)
    grads = sorted(failing - set(FORWARD_QUANTITIES))
    if grads and not failing & set(FORWARD_QUANTITIES):
        return (
            f"Likely difference: identify reads the forward of {_fn_name(fn)} as the spec's, and "
            f"only gradients fail ({', '.join(grads)}): its backward differs (the gradients "
            "autograd takes through an eager half-precision forward are backward='autograd')"
        )
    return (
        f"Likely difference: none that identify can name (it reads {_fn_name(fn)} as "
        f"{found.spec!r}); the figures below show where it departs"
    )


def _forward_only(
    fn: Callable[..., Any], spec: NormSpec, backend: str, params: bool, device: str
) -> Callable[..., Any]:
    """``fn`` as identify calls it, ``(x[, gate][, scale, bias]) -> y``: a residual spec's
    ``fn`` with a zero residual (``y`` of ``h = x``), DyT's with its ``alpha_init``."""
    if spec.residual is not None:
        def added(x: Any, *rest: Any) -> Any:
            return fn(x, x * 0, *rest)[0]

        return added
    if spec.kind == "dyt" and params:
        assert spec.alpha_init is not None
        alpha = get_bridge(backend).to_tensor(np.array([spec.alpha_init], np.float32), device)

        def with_alpha(x: Any, scale: Any, bias: Any) -> Any:
            return fn(x, scale, bias, alpha)

        return with_alpha
    return fn


def _checked_quantities(spec: NormSpec, grad: bool, params: bool) -> tuple[str, ...]:
    """What is compared: the outputs (``y``, and ``h`` with a residual), with ``grad`` the
    gradients of the arrays ``fn`` is given."""
    names = quantities(spec)
    if not grad:
        return tuple(q for q in names if q in FORWARD_QUANTITIES)
    if params:
        return names
    return tuple(q for q in names if q in ("y", "dx", "dgate", "h", "dresidual"))


def _check_spec(spec: object) -> None:
    if not isinstance(spec, NormSpec):
        raise TypeError(
            f"spec must be a normkit.NormSpec, got {type(spec).__name__} {spec!r}; "
            "e.g. NormSpec('rms', eps=1e-5)"
        )


def _checked_arguments(
    spec: object, dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]]
) -> tuple[list[str], list[tuple[int, ...]]]:
    """The dtype names and shapes to check; TypeError/ValueError naming what is wrong."""
    _check_spec(spec)
    assert isinstance(spec, NormSpec)
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
        spec.group_count(math.prod(spec.param_shape(tuple(shape))))  # whole groups
        sizes.append(tuple(int(d) for d in shape))
    return names, sizes


class _CheckedFn:
    """``fn`` as the bridges call it, ``(x, scale, bias) -> y``, refusing outputs that are not
    one of the framework's arrays of the input's shape (or, for gradients in torch, detached
    ones) with an AssertionError. ``returned`` records that ``fn`` itself returned, so a later
    framework error is the backward's.

    The bridges' forward takes one input, two parameters and one output, and the VJP is called
    the same way; `pack` fits the extended calls into them: a residual spec's ``x`` and
    ``residual`` travel stacked (``fn`` gets the two halves), its ``(y, h)`` come back stacked
    in their promoted dtype (each cotangent is exact in it; `unpack` restores their own dtypes,
    recorded in ``out_dtypes``); a gated spec's ``x`` and ``gate`` travel stacked the same way
    (one output; the input's gradient holds ``dx`` and ``dgate``); DyT's ``alpha`` travels after
    the scale's elements.
    """

    def __init__(
        self, fn: Callable[..., Any], backend: str, spec: NormSpec, params: bool, grad: bool,
        label: str,
    ):
        self.fn = fn
        self.backend = backend
        self.residual = spec.residual is not None
        self.gated = spec.gate is not None
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
        x, dy, scale, bias, residual, dh, alpha, gate = inputs
        if self.gated:
            assert gate is not None
            x = np.stack([x, gate.astype(x.dtype)])
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
        if self.gated:
            found["dx"], found["dgate"] = (None, None) if dx is None else (dx[0], dx[1])
        if self.alpha:
            size = 0 if inputs.scale is None else inputs.scale.size
            found["dalpha"] = None if dscale is None else dscale[size:]
            found["dscale"] = None
            if dscale is not None and inputs.scale is not None:
                found["dscale"] = dscale[:size].reshape(inputs.scale.shape)
        return found

    def __call__(self, x: Any, scale: Any = None, bias: Any = None) -> Any:
        args = [x[0], x[1]] if self.residual or self.gated else [x]
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
            raise _NotConforming(
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
            raise _NotConforming(
                f"{where} returned {what}{kind}; it must return a {_ARRAY_TYPES[self.backend]} "
                "of the input's shape"
            )
        if tuple(y.shape) != shape:
            raise _NotConforming(
                f"{where} returned {what}shape {tuple(y.shape)} for an input of shape {shape}; "
                "a norm keeps the input's shape"
            )
        if self.grad and self.backend == "torch" and not y.requires_grad:
            raise _NotConforming(
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
        raise _NotConforming(f"{where} returned an array of dtype {name}, not a float dtype")
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
    return _NotConforming(
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
            raise _NotConforming(
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


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
