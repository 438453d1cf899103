"""`NormSpec` as pure JAX functions with an analytic `jax.custom_vjp`.

`normalize` computes every spec without a residual, `add_norm` those with one (returning
``(y, h)``). The backward pass saves only the values normalized (the input, or ``h``) and the
statistic ``s`` per row (float32, or float64 for float64 inputs), besides references to the
parameters. With ``backward="autograd"`` there is no custom VJP: JAX differentiates the eager
formula, rounding where the eager program rounds. The functions work under ``jit``, ``grad``,
``vmap``, ``remat`` and ``scan``, and inside ``shard_map`` with ``axis_name``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypedDict, TypeVar, Unpack, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from normkit import _dyt
from normkit import _jax_exact as _exact
from normkit import _pallas as pallas
from normkit._jax_rounding import offset_in_dtype, round_to
from normkit.jax import _gated
from normkit.spec import Cast, EpsPlacement, Kind, NormSpec

__all__ = ["normalize", "add_norm", "rms_norm", "partial_rms_norm", "layer_norm",
           "Implementation", "IMPLEMENTATIONS"]

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_T = TypeVar("_T")

Implementation = Literal["xla", "pallas"]
"""Which program computes a call: XLA's, or the Pallas kernels on NVIDIA GPUs (`normalize`)."""
IMPLEMENTATIONS: tuple[Implementation, ...] = ("xla", "pallas")
#: The environment variable that selects the implementation where a call gives none.
KERNELS_VARIABLE = pallas.KERNELS_VARIABLE


@dataclass(frozen=True)
class _Plan:
    """What the custom_vjp needs besides the arrays; hashable, so it is a static argument.

    ``dtype`` is the input dtype whose policy applies (its cast points), ``out`` the output
    dtype, ``residual_dtype`` the residual's (None without one).
    """

    spec: NormSpec
    axes: tuple[int, ...]
    axis_name: str | None
    dtype: jnp.dtype
    out: jnp.dtype
    residual_dtype: jnp.dtype | None = None


def normalize(
    x: jax.Array,
    spec: NormSpec,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    gate: jax.Array | None = None,
    alpha: jax.Array | None = None,
    dtype: DTypeLike | None = None,
    axis_name: str | None = None,
    mask: jax.Array | None = None,
    implementation: Implementation | None = None,
) -> jax.Array:
    r"""``spec`` applied to ``x`` (see `NormSpec` for the math and the dtype policy).

    Per row ``x`` over ``spec.axis``: ``y = y_hat * (scale_offset + scale) + bias`` with
    ``y_hat = x r(s)`` (RMS kinds), ``(x - mean(x)) r(s)`` (LayerNorm, variance in two passes
    or, with ``variance="fast"``, as ``max(0, mean(x^2) - mean(x)^2)`` with each step rounded
    to float32) or ``tanh(alpha x)`` (DyT). Statistics are computed in float32 (float64 for
    float64 inputs).

    Args:
      x: a floating-point array (float16, bfloat16, float32 or float64).
      spec: the norm, without a residual (`add_norm` computes those).
      scale: ``w``, of shape ``spec.param_shape(x.shape)``, any float dtype; None means its
        initial value (effective scale 1). With ``offset_dtype="param"``, ``scale_offset + w``
        is rounded to ``scale``'s dtype.
      bias: ``b``, of the same shape; None means zero.
      gate: ``z``, a float array of ``x``'s shape, required exactly when ``spec.gate`` is set:
        ``y(x * a(z))`` (``gate="before"``) or ``y(x) * a(z)`` (``"after"``), ``a`` computed
        in float32 (float64 for float64 inputs). Gated and grouped specs (``group_size``) take
        neither ``axis_name`` nor ``mask``.
      alpha: DyT's ``alpha``, shape ``()`` or ``(1,)``; None means ``spec.alpha_init`` (a
        constant). Only for ``kind="dyt"``.
      dtype: the dtype to compute in; ``x`` is cast to it first. None: ``x.dtype``.
      axis_name: the mesh axis (``shard_map``/``pmap``) the normalized axes are sharded over;
        the statistics are then reduced across it, so each shard gets the unsharded result.
        With ``kind="partial_rms"`` the statistic reads the first ``k = spec.stat_size(N)``
        elements of the global row of ``N = n * axis_size`` elements (shards in mesh order);
        this needs a single normalized axis. DyT, elementwise, ignores it.
      mask: Flax's call-time ``mask``, as `normkit.reference.normalize` defines it: a bool (or
        numeric, nonzero meaning True) array broadcastable to ``x``. The mean and the statistic
        of a row read only its K elements where ``mask`` is True (``mean_m(v) = sum_{mask} v /
        K``: ``s = mean_m(x^2)``, for LayerNorm ``mean_m((x - mean_m(x))^2)``, with
        ``variance="fast"`` ``max(0, mean_m(x^2) - mean_m(x)^2)`` rounded as without a mask);
        every element is normalized with them and gets the affine step. Masked-out values never
        reach the statistic; a row with K = 0 is NaN. The same analytic VJP as without a mask.
        ``rms`` and ``layer`` only, without ``axis_name``.
      implementation: ``"xla"`` (the XLA program on every platform) or ``"pallas"`` (the Pallas
        kernels of `normkit.jax.pallas` on NVIDIA GPUs, chosen when the program is lowered; the
        XLA program elsewhere, and for what the kernels do not compute: ``axis_name``,
        ``backward="autograd"``, float64, normalized axes that are not the trailing ones, rows
        beyond `normkit.jax.pallas.MAX_BLOCK`). A ``mask`` reaches the kernels as one byte per
        element. Experimental. None: the environment variable ``NORMKIT_JAX_KERNELS``
        (``"pallas"`` or ``"xla"``), else ``"xla"``.

    Returns:
      An array of ``x``'s shape, of dtype ``dtype`` (default ``x.dtype``), or with
      ``output_dtype="promote"`` the promoted dtype of that and the parameters given.

    Raises:
      TypeError: ``x`` (or ``dtype``, ``scale``, ``bias``, ``alpha``) is not floating-point.
      TypeError: ``mask`` is neither bool nor numeric.
      ValueError: an axis is out of range, a parameter has the wrong shape or is given although
        the spec lacks it, partial RMS is sharded over several normalized axes, ``spec.eps``
        is out of the range of the compute dtype (`NormSpec.check_eps`), the spec has a
        residual, or a ``mask`` is given for partial RMS, DyT or with ``axis_name``, or does
        not broadcast to ``x``, or ``implementation`` is none of the above.
    """
    _check_residual_kind(spec, add=False)
    kernels = pallas.selected(implementation)
    x, plan = _prepare(x, spec, scale, bias, alpha, dtype, axis_name)
    gate = _checked_gate(gate, x, spec)
    if spec.gate is not None or spec.group_size is not None:
        return _gated_or_grouped(kernels, plan, x, gate, scale, bias, mask)
    checked = None if mask is None else _checked_mask(mask, x, plan)
    inputs = _Inputs(x, scale=scale, bias=bias, alpha=_alpha(plan, alpha), mask=checked)
    return cast(jax.Array, _dispatched(kernels, functools.partial(_run, plan), plan, inputs))


def add_norm(
    x: jax.Array,
    residual: jax.Array,
    spec: NormSpec,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    alpha: jax.Array | None = None,
    dtype: DTypeLike | None = None,
    axis_name: str | None = None,
    implementation: Implementation | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""``h = x + residual`` rounded as ``spec.residual`` says, and ``(normalize(h), h)``.

    With ``t`` the input dtype and ``c`` the compute dtype (float32; float64 for float64)::

        "rounded":             h = round_t(x + residual); y = norm(h)             h in t
        "float32":             h = round_c(x + residual); y = norm(h)             h in c
        "float32_normalized":  s = round_c(x + residual); y = norm(s); h = round_t(s)  h in t

    ``norm`` has the dtype policy of inputs of dtype ``t``. The gradient of ``x`` and of
    ``residual`` is ``dh + dnorm``, rounded once to each one's dtype.

    Args:
      x: the input, as in `normalize`.
      residual: ``x``'s shape and dtype, or with ``residual="float32"`` a ``c`` array (a
        residual stream kept in float32).
      spec: the norm, with a residual.
      scale, bias, alpha, dtype, axis_name, implementation: as in `normalize`; with ``dtype``
        the residual is cast to it too, unless ``residual="float32"`` and it is already in
        ``c``. The kernels add the residual in the same program as the norm.

    Returns:
      ``(y, h)``.

    Raises:
      TypeError: the residual has a dtype the spec does not allow (or see `normalize`).
      ValueError: the spec has no residual, the residual's shape is not ``x``'s (or see
        `normalize`).
    """
    _check_residual_kind(spec, add=True)
    kernels = pallas.selected(implementation)
    x, plan = _prepare(x, spec, scale, bias, alpha, dtype, axis_name)
    residual = _checked_residual(residual, x, plan, cast=dtype is not None)
    plan = dataclasses.replace(plan, residual_dtype=jnp.dtype(residual.dtype))

    inputs = _Inputs(x, residual, scale=scale, bias=bias, alpha=_alpha(plan, alpha))
    pair = _dispatched(kernels, functools.partial(_run, plan), plan, inputs)
    return cast(tuple[jax.Array, jax.Array], pair)


# --- the choice of program ---------------------------------------------------------------------


class _Inputs(NamedTuple):
    """A call's arrays, None where it has none: what a program takes (`_dispatched`), the
    custom VJP differentiates and the Pallas kernels read (`normkit._pallas.run`)."""

    x: jax.Array
    residual: jax.Array | None = None
    gate: jax.Array | None = None
    scale: jax.Array | None = None
    bias: jax.Array | None = None
    alpha: jax.Array | None = None
    mask: jax.Array | None = None


_Output = jax.Array | tuple[jax.Array, jax.Array]
_Program = Callable[[_Inputs], _Output]


def _dispatched(kernels: bool, xla: _Program, plan: _Plan, inputs: _Inputs) -> _Output:
    """``xla(inputs)``, or where the ``kernels`` are asked for and compute the call,
    `lax.platform_dependent` between them (CUDA) and ``xla`` (every other platform): the choice
    is made when the program is lowered, and XLA compiles only the platform's own (inside
    `normkit._pallas.interpreted`: the kernels, interpreted)."""
    if not kernels or plan.axis_name is not None or not pallas.supports(
        inputs.x, plan.spec, plan.axes, inputs[1:6]
    ):
        return xla(inputs)

    def on_gpu(inputs: _Inputs) -> _Output:
        x, residual, gate, scale, bias, alpha, mask = inputs
        return pallas.run(x, residual, plan.spec, scale, bias, gate, alpha, plan.out, mask,
                          interpret=pallas.interpreting())

    if pallas.interpreting():
        return on_gpu(inputs)
    return cast(_Output, lax.platform_dependent(inputs, cuda=on_gpu, default=xla))


def _gated_or_grouped(
    kernels: bool, plan: _Plan, x: jax.Array, gate: jax.Array | None,
    scale: jax.Array | None, bias: jax.Array | None, mask: jax.Array | None,
) -> jax.Array:
    """`normalize` of a gated or grouped spec (`normkit.jax._gated`: ``y(x * a(z))``, ``y(x) *
    a(z)``, each group of ``group_size`` features normalized alone), whose rows the XLA
    program computes; neither ``axis_name`` nor ``mask``."""
    if plan.axis_name is not None or mask is not None:
        raise ValueError(
            "normalize: a gated or grouped spec (gate, group_size) takes neither axis_name "
            "nor mask"
        )
    plan.spec.group_count(math.prod(x.shape[a] for a in plan.axes))

    def gated(inputs: _Inputs) -> jax.Array:
        rows = functools.partial(normalize, implementation="xla")
        return _gated.gated_or_grouped(
            inputs.x, inputs.gate, plan.spec, inputs.scale, inputs.bias, plan.out, rows
        )

    inputs = _Inputs(x, gate=gate, scale=scale, bias=bias)
    return cast(jax.Array, _dispatched(kernels, gated, plan, inputs))


def _check_residual_kind(spec: NormSpec, add: bool) -> None:
    """`add_norm` (``add``) computes the specs with a residual, but not grouped ones;
    `normalize` those without."""
    if not add and spec.residual is not None:
        raise ValueError(
            f"normalize: the spec has residual={spec.residual!r}, which adds a residual before "
            "the norm; use add_norm(x, residual, spec, ...), which returns (y, h)"
        )
    if add and spec.residual is None:
        raise ValueError(
            "add_norm needs a spec with a residual rounding (residual='rounded', 'float32' or "
            "'float32_normalized'), got residual=None; use normalize"
        )
    if add and spec.group_size is not None:
        raise ValueError(
            f"add_norm: normkit.jax does not compute a residual with group_size={spec.group_size}"
            " (normkit.torch does); add the residual and use normalize"
        )


def _prepare(
    x: jax.Array,
    spec: NormSpec,
    scale: jax.Array | None,
    bias: jax.Array | None,
    alpha: jax.Array | None,
    dtype: DTypeLike | None,
    axis_name: str | None,
) -> tuple[jax.Array, _Plan]:
    """``x`` cast to ``dtype`` and the plan, after checking every argument."""
    x = as_array("x", x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"x has dtype {x.dtype}; normkit norms need a floating-point input "
            "(float16, bfloat16, float32 or float64)"
        )
    in_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if not jnp.issubdtype(in_dtype, jnp.floating):
        raise TypeError(f"dtype={in_dtype} is not a floating-point dtype")
    x = x.astype(in_dtype)
    spec.check_eps(in_dtype.name)
    axes = spec.resolve_axes(x.ndim)
    if spec.kind == "partial_rms" and axis_name is not None and len(axes) != 1:
        raise ValueError(
            f"partial RMS with axis_name={axis_name!r} needs a single normalized axis, got "
            f"axes {axes}: the global order of the first k elements is undefined otherwise"
        )
    expected = spec.param_shape(x.shape)
    for name, value, present in (("scale", scale, spec.scale), ("bias", bias, spec.bias)):
        if value is None:
            continue
        if not present:
            raise ValueError(f"{name} was given but the spec has {name}=False")
        _check_float(name, value)
        if jnp.shape(value) != expected:
            raise ValueError(
                f"{name} has shape {jnp.shape(value)}, but x of shape {x.shape} normalized over "
                f"axes {axes} needs {expected}: wrong feature size for this layer"
            )
    if alpha is not None:
        if spec.kind != "dyt":
            raise ValueError(f"alpha was given but the spec has kind={spec.kind!r} (not 'dyt')")
        _check_float("alpha", alpha)
        if jnp.shape(alpha) not in ((), (1,)):
            raise ValueError(
                f"alpha has shape {jnp.shape(alpha)}, expected a scalar (shape () or (1,))"
            )
    for a in axes:
        if x.shape[a] == 0:
            raise ValueError(f"x has shape {x.shape}: the normalized axis {a} is empty")
    out = in_dtype
    if spec.output_dtype == "promote":
        for value in (scale, bias, alpha):
            if value is not None:
                out = jnp.promote_types(out, jnp.result_type(value))
    return x, _Plan(spec, axes, axis_name, in_dtype, jnp.dtype(out))


def as_array(name: str, value: object) -> jax.Array:
    """``value`` as a JAX array; a TypeError naming the argument ``name`` if it is not an array
    of numbers or bools (a string, an arbitrary object), which JAX itself reports without it."""
    try:
        return jnp.asarray(value)
    except TypeError as error:
        raise TypeError(
            f"{name} must be an array of numbers or bools, got {type(value).__name__} "
            f"{value!r:.60}"
        ) from error


def _checked_gate(gate: jax.Array | None, x: jax.Array, spec: NormSpec) -> jax.Array | None:
    """The gate, given exactly when ``spec.gate`` is set: a float array of x's shape."""
    if spec.gate is None:
        if gate is not None:
            raise ValueError(
                "normalize: a gate was given but the spec has gate=None; build the spec with "
                "gate='before' or 'after' to gate the norm"
            )
        return None
    if gate is None:
        raise ValueError(
            f"normalize: the spec has gate={spec.gate!r}, which needs the gate array: "
            "normalize(x, spec, scale, bias, gate=z)"
        )
    _check_float("gate", gate)
    gate = as_array("gate", gate)
    if gate.shape != x.shape:
        raise ValueError(f"gate has shape {gate.shape}, x has {x.shape}")
    return gate


def _check_float(name: str, value: jax.Array) -> None:
    dtype = as_array(name, value).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} has dtype {dtype}; expected a float dtype")


def _checked_residual(residual: jax.Array, x: jax.Array, plan: _Plan, cast: bool) -> jax.Array:
    """The residual, of x's shape and an allowed dtype (cast to x's with ``dtype=``)."""
    residual = as_array("residual", residual)
    compute = _stat_dtype(plan.dtype)
    mode = plan.spec.residual
    if cast and not (mode == "float32" and residual.dtype == compute):
        residual = residual.astype(plan.dtype)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual has shape {residual.shape}, expected the shape of x, {x.shape}"
        )
    allowed = {plan.dtype, compute} if mode == "float32" else {plan.dtype}
    if residual.dtype not in allowed:
        names = " or ".join(sorted(d.name for d in allowed))
        raise TypeError(
            f"residual has dtype {residual.dtype}; residual={mode!r} with x of dtype "
            f"{plan.dtype} needs {names}"
        )
    return residual


def _checked_mask(mask: jax.Array, x: jax.Array, plan: _Plan) -> jax.Array:
    """``mask`` as booleans of ``x``'s shape, for a spec whose statistic a mask can restrict
    (the checks of `normkit.reference.normalize`)."""
    plan.spec.check_maskable()
    if plan.axis_name is not None:
        raise ValueError(
            f"mask with axis_name={plan.axis_name!r} is not supported: the masked statistic is "
            "computed per shard only"
        )
    mask = as_array("mask", mask)
    if mask.dtype != jnp.bool_ and not jnp.issubdtype(mask.dtype, jnp.number):
        raise TypeError(f"mask has dtype {mask.dtype}; expected bool or numbers (nonzero: True)")
    try:
        return jnp.broadcast_to(mask != 0, x.shape)
    except ValueError:
        raise ValueError(
            f"mask has shape {mask.shape}, which does not broadcast to x's shape {x.shape}"
        ) from None


def _alpha(plan: _Plan, alpha: jax.Array | None) -> jax.Array | None:
    """DyT's alpha as given, or ``spec.alpha_init`` as a constant; None for the other kinds."""
    if plan.spec.kind != "dyt":
        return None
    if alpha is None:
        return jnp.asarray(plan.spec.alpha_init, _stat_dtype(plan.dtype))
    return jnp.asarray(alpha)


class NormOptions(TypedDict, total=False):
    """The keyword arguments of `rms_norm`, `partial_rms_norm` and `layer_norm`: the `NormSpec`
    fields ``eps``, ``eps_placement``, ``axis``, ``scale_offset`` and ``cast``, with their
    NormSpec meaning and defaults, and `normalize`'s ``dtype``, ``axis_name`` and
    ``implementation``."""

    eps: float
    eps_placement: EpsPlacement
    axis: int | tuple[int, ...]
    scale_offset: float
    cast: Cast
    dtype: DTypeLike | None
    axis_name: str | None
    implementation: Implementation | None


_SPEC_OPTIONS = ("eps", "eps_placement", "axis", "scale_offset", "cast")


def rms_norm(
    x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None,
    **options: Unpack[NormOptions],
) -> jax.Array:
    """RMSNorm: `normalize` with ``NormSpec(kind="rms", ...)`` built from ``options``
    (`NormOptions`); the spec has a bias when ``bias`` is given."""
    return _shorthand("rms", None, x, scale, bias, options)


def partial_rms_norm(
    x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None, *, p: float,
    **options: Unpack[NormOptions],
) -> jax.Array:
    """Partial RMSNorm (statistic over the first ``spec.stat_size(n)`` elements of a row).

    `normalize` with ``NormSpec(kind="partial_rms", p=p, ...)``; arguments as in `rms_norm`.
    """
    return _shorthand("partial_rms", p, x, scale, bias, options)


def layer_norm(
    x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None,
    **options: Unpack[NormOptions],
) -> jax.Array:
    """LayerNorm: `normalize` with ``NormSpec(kind="layer", ...)``; arguments as in `rms_norm`."""
    return _shorthand("layer", None, x, scale, bias, options)


def _shorthand(
    kind: Kind, p: float | None, x: jax.Array, scale: jax.Array | None,
    bias: jax.Array | None, options: NormOptions,
) -> jax.Array:
    """`normalize` with the spec of ``kind`` the shorthands' ``options`` give."""
    unknown = sorted(set(options) - set(NormOptions.__annotations__))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; expected those of "
                        f"NormOptions: {', '.join(NormOptions.__annotations__)}")
    fields: dict[str, Any] = {k: v for k, v in options.items() if k in _SPEC_OPTIONS}
    spec = NormSpec(kind=kind, p=p, bias=bias is not None, **fields)
    return normalize(x, spec, scale, bias, dtype=options.get("dtype"),
                     axis_name=options.get("axis_name"),
                     implementation=options.get("implementation"))


# --- the computation ------------------------------------------------------------------------


def _stat_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _psum(value: jax.Array, plan: _Plan) -> jax.Array:
    return value if plan.axis_name is None else lax.psum(value, plan.axis_name)


def _row_size(x: jax.Array, plan: _Plan) -> int:
    """n: the number of elements in a (global) row."""
    n = int(np.prod([x.shape[a] for a in plan.axes]))
    return n if plan.axis_name is None else n * lax.axis_size(plan.axis_name)


class _Reads(NamedTuple):
    """The elements of a row the statistic reads: ``where`` (broadcastable to the input; None
    for all of them), their number per row, ``size`` (an int, or per row with a mask), and
    ``prefix``: the axis they are the first ``size`` elements of (partial RMS over one
    unsharded axis; None otherwise), where a mean reads that slice alone."""

    where: jax.Array | None
    size: int | jax.Array
    prefix: int | None = None


def _reads(x: jax.Array, plan: _Plan, mask: jax.Array | None) -> _Reads:
    """The call's ``mask`` (with its count per row), partial RMS's first k, or every element."""
    if mask is not None:
        return _Reads(mask, jnp.sum(mask, axis=plan.axes, keepdims=True, dtype=x.dtype))
    if plan.spec.kind == "partial_rms":
        single = len(plan.axes) == 1 and plan.axis_name is None
        return _Reads(*_partial_mask(x, plan), prefix=plan.axes[0] if single else None)
    return _Reads(None, _row_size(x, plan))


def _row_sum(value: jax.Array, plan: _Plan, where: jax.Array | None = None) -> jax.Array:
    """The sum per row (keepdims, over every shard) of ``value`` where ``where`` is True (all
    of it for None)."""
    if where is not None:
        value = jnp.where(where, value, 0)
    return _psum(jnp.sum(value, axis=plan.axes, keepdims=True), plan)


def _read_mean(value: jax.Array, plan: _Plan, reads: _Reads) -> jax.Array:
    """The mean per row of ``value`` over the elements read (0 / 0 = NaN where none is)."""
    if reads.prefix is not None:  # XLA then reads the k elements, not a masked copy of all n
        assert isinstance(reads.size, int)
        first = lax.slice_in_dim(value, 0, reads.size, axis=reads.prefix)
        return _row_sum(first, plan) / reads.size
    return _row_sum(value, plan, reads.where) / reads.size


def _partial_mask(x: jax.Array, plan: _Plan) -> tuple[jax.Array, int]:
    """The elements the partial statistic reads (broadcastable to x), and their count k."""
    k = plan.spec.stat_size(_row_size(x, plan))
    shape = [x.shape[a] if a in plan.axes else 1 for a in range(x.ndim)]
    local = lax.broadcasted_iota(jnp.int32, shape, plan.axes[0])
    for a in plan.axes[1:]:
        local = local * x.shape[a] + lax.broadcasted_iota(jnp.int32, shape, a)
    if plan.axis_name is not None:
        local = local + lax.axis_index(plan.axis_name) * x.shape[plan.axes[0]]
    return local < k, k


def _centered(xf: jax.Array, plan: _Plan, reads: _Reads) -> jax.Array:
    """``x - mean(x)`` per row for LayerNorm (``x`` for the RMS kinds), the mean over the
    elements read, with one correction pass: the mean of the centered values is subtracted
    again, recovering what the rounding of a large mean loses."""
    if plan.spec.kind != "layer":
        return xf
    if _careful_only(plan, reads):
        # x - mean(x) = (x - x_other) / 2 (flipping the normalized axes swaps the two elements):
        # one rounding, relative to the centered values; the mean's rounding is relative to |x|,
        # which at n = 2 can dwarf them.
        return (xf - jnp.flip(xf, axis=plan.axes)) / 2
    c = xf - _read_mean(xf, plan, reads)
    return c - _read_mean(c, plan, reads)


def _statistic(c: jax.Array, plan: _Plan, reads: _Reads) -> jax.Array:
    """s per row (keepdims): the mean of c**2 over the elements read."""
    return _read_mean(c * c, plan, reads)


def _r(s: jax.Array, eps: float | jax.Array, spec: NormSpec) -> jax.Array:
    """``r(s) = 1 / sqrt(s + eps)`` (inside) or ``1 / (sqrt(s) + eps)`` (outside): normkit.jax's
    one definition (the Pallas kernels keep their own, `normkit._pallas_rows`)."""
    if spec.eps_placement == "inside":
        return lax.rsqrt(s + eps)
    return 1 / (jnp.sqrt(s) + eps)


# Rows whose r(s) falls outside [2**-e, 2**e] (or is NaN on a finite row) are recomputed in
# scaled units: there s, or the sums behind it, may have overflowed or underflowed. For the
# gradient with eps outside, so are rows with s below 2**-2e (`_needs_scaling`).
_SAFE_EXPONENT = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.float64): 256}


def _needs_scaling(s: jax.Array, plan: _Plan, gradient: bool) -> jax.Array:
    """Per row, whether the plain statistic ``s`` cannot be used as it is: ``r(s)`` is out of
    ``[2**-e, 2**e]`` or NaN, or (``gradient``, eps outside) ``s < 2**-2e``. The gradient's
    term ``x_i r'(s) = -r**2 x_i / (2 sqrt(s))`` reads ``x_i / sqrt(s)``, which is scale-free
    but exact only while the squares behind ``s`` are normal numbers (XLA flushes subnormals to
    zero: s underflows to 0 long before r notices, r being near ``1 / eps``)."""
    assert plan.spec.eps is not None  # a normalization kind
    bound = 2.0 ** _SAFE_EXPONENT[jnp.dtype(s.dtype)]
    r = _r(s, plan.spec.eps, plan.spec)
    bad = ~((r >= 1 / bound) & (r <= bound))
    if gradient and plan.spec.eps_placement == "outside":
        bad |= s < 1 / (bound * bound)
    return bad


def _row_max(value: jax.Array, plan: _Plan) -> jax.Array:
    """The largest value per row, a constant to autodiff (``pmax`` has no derivative rule)."""
    m = jnp.max(lax.stop_gradient(value), axis=plan.axes, keepdims=True)
    return m if plan.axis_name is None else lax.pmax(m, plan.axis_name)


class _Scaled(NamedTuple):
    """Rows in scaled units: ``c = pre * sigma * centered``, ``s`` its statistic and ``eps`` the
    eps giving the same ``y_hat = c r(s)``; the true ``r`` is ``pre * sigma * r(s)``. ``pre`` is
    1 or a power of two that keeps ``sigma`` a normal number (XLA flushes subnormals to zero)."""

    c: jax.Array
    s: jax.Array
    eps: jax.Array
    sigma: jax.Array
    pre: jax.Array


def _reciprocal_power_of_two(m: jax.Array) -> jax.Array:
    """``2**-e`` with ``m 2**-e`` in [1/2, 1) for finite positive normal ``m`` (0 for an
    infinite ``m``, NaN for NaN): scaling by it is exact, where ``1 / m`` rounds every value it
    scales, by ``2**-24`` of ``|x|``, which centering a large mean turns into ``|mean| / std``
    times that of the centered values."""
    finite = jnp.isfinite(m)
    _, e = jnp.frexp(jnp.where(finite, m, 1))
    return jnp.where(finite, jnp.ldexp(jnp.ones_like(m), -e), 1 / m)


def _rescaled(xf: jax.Array, plan: _Plan, reads: _Reads) -> _Scaled:
    """Every row divided by its largest magnitude (at least a floor), rounded to a power of
    two, so that s lies in [1/(4k), 1].

    ``sigma = 1 / max(max|x|, floor)`` (`_reciprocal_power_of_two`) over the elements the
    statistic reads, ``floor =
    sqrt(eps)`` (inside: the scaled eps stays at most 1) or ``eps 2**-2e`` (outside: the scaled
    eps stays at most ``2**2e``, and rows far below eps still reach unit scale, where the
    gradient reads ``x / sqrt(s)``); LayerNorm rows are scaled, centered, then scaled again by
    their largest centered value read. The scaling is a constant to autodiff: ``y_hat`` does
    not depend on it.
    """
    spec = plan.spec
    assert spec.eps is not None  # a normalization kind
    outside = spec.eps_placement == "outside"
    exponent = _SAFE_EXPONENT[jnp.dtype(xf.dtype)]
    floor = spec.eps * 2.0 ** (-2 * exponent) if outside else float(np.sqrt(spec.eps))
    tiny = float(jnp.finfo(xf.dtype).tiny)
    big = 2.0 ** (2 * exponent)
    def largest_read(values: jax.Array) -> jax.Array:
        magnitude = jnp.abs(values)
        if reads.where is not None:
            magnitude = jnp.where(reads.where, magnitude, 0)
        return _row_max(magnitude, plan)

    largest = largest_read(xf)
    pre = jnp.where(largest > big, 1 / big, 1.0).astype(xf.dtype)
    sigma = _reciprocal_power_of_two(jnp.maximum(largest * pre, jnp.maximum(floor * pre, tiny)))
    c = xf * pre * sigma
    scaled_floor = floor * pre * sigma
    if spec.kind == "layer":
        c = _centered(c, plan, reads)
        widest = largest_read(c)
        second = _reciprocal_power_of_two(jnp.maximum(widest, jnp.maximum(scaled_floor, tiny)))
        c, sigma, scaled_floor = c * second, sigma * second, scaled_floor * second
    s = _statistic(c, plan, reads)
    if outside:
        eps = jnp.maximum(spec.eps * pre * sigma, tiny)
    else:
        eps = jnp.maximum(scaled_floor * scaled_floor, tiny)
    return _Scaled(c, s, eps, sigma, pre)


def _rows(xf: jax.Array, plan: _Plan, reads: _Reads, gradient: bool = False) -> _Scaled:
    """The rows in scaled units: as they are, except those `_needs_scaling` flags (for the
    ``gradient`` or the forward pass), which `_rescaled` recomputes. The rescaling runs only when
    some row needs it."""
    assert plan.spec.eps is not None  # a normalization kind
    c = _centered(xf, plan, reads)
    s = _statistic(c, plan, reads)
    bad = _needs_scaling(s, plan, gradient)
    eps = jnp.full_like(s, plan.spec.eps)

    def rescale(rows: _Scaled) -> _Scaled:
        scaled = _rescaled(xf, plan, reads)
        # Rows holding an inf or a NaN get sigma = 0 or NaN and keep their plain values.
        use = bad & (scaled.sigma > 0)
        return _Scaled(*(jnp.where(use, new, old) for new, old in zip(scaled, rows, strict=True)))

    one = jnp.ones_like(s)
    return _patched(bad, _Scaled(c, s, eps, one, one), rescale)


def _patched(bad: jax.Array, value: _T, fix: Callable[[_T], _T]) -> _T:
    """``fix(value)`` if any row is ``bad``, else ``value`` untouched: under tracing a
    ``lax.cond`` whose common branch passes ``value`` through, so that nothing is computed twice
    and the common case runs none of ``fix``; eagerly decided in Python (a cond's branches,
    fresh closures here, would be compiled on every call)."""
    any_bad = jnp.any(bad)
    if isinstance(any_bad, jax.core.Tracer):
        return lax.cond(any_bad, fix, lambda unchanged: unchanged, value)
    return fix(value) if bool(any_bad) else value


class _Plain(NamedTuple):
    """Per row (keepdims), the statistics of the common program (``s`` is the backward pass's
    residual): ``mean`` (LayerNorm: ``c = x - mean``; None for the RMS kinds), the statistic
    ``s``, and ``careful``: whether the row takes the careful program (`_careful_y_hat`)
    instead."""

    mean: jax.Array | None
    s: jax.Array
    careful: jax.Array


def _plain(
    v: jax.Array,
    plan: _Plan,
    reads: _Reads,
    s: jax.Array | None = None,
    fused: bool = False,
    copies: Sequence[jax.Array] = (),
) -> _Plain:
    """The common program's statistics, in as few passes over ``v`` as the spec allows (one
    fused reduction; LayerNorm's two-pass variance two), and which rows they cannot serve:

    - ``r(s)`` out of range (`_needs_scaling`: rows to rescale);
    - LayerNorm, ``|mean| > sqrt(s)`` (`_large_mean`): a large mean, whose rounding
      (relative to ``|mean|``) the careful program's correction pass recovers, and where with
      ``variance="fast"`` the rounding of each step of ``mean(x^2) - mean^2``, exact only
      there, decides the result. Elsewhere the plain means are within a few ulps of
      ``sqrt(s)`` and ``s``.

    With ``s`` given (the saved one, in the backward pass) only the mean is computed again.
    ``fused``: ``y``'s pass alone reads the statistics (`_fused_apart`), and XLA may compute
    them in that pass. ``copies``: ``v`` as each reduction in turn reads it (copies of its own,
    `_barrier`), where not ``v`` itself.
    """
    spec = plan.spec
    source = iter(copies) if copies else itertools.repeat(v)
    mean = None
    if spec.kind != "layer":
        if s is None:
            w = next(source)
            s = _read_mean(w * w, plan, reads)
        careful = jnp.zeros(s.shape, bool)
    else:
        mean = _read_mean(next(source), plan, reads)
        if s is None and spec.variance == "fast":
            w = next(source)
            s = jnp.maximum(_read_mean(w * w, plan, reads) - mean * mean, 0)
        elif s is None:
            s = _read_mean(jnp.square(next(source) - mean), plan, reads)
            if not fused:
                # Read by y's pass and the flags as well, the mean would otherwise reach the
                # variance's reduction as a broadcast array XLA writes out: a pass more.
                mean = lax.optimization_barrier(mean)
        careful = _large_mean(mean, s)
    return _Plain(mean, s, careful | _needs_scaling(s, plan, gradient=False))


# From this many rows on, XLA's CPU backend computes a row reduction of a bfloat16 or float32
# x and the elementwise work using it in one YNNPACK pass, if the reduction has no other user.
_CPU_FUSED_ROWS = 4096


def _fused_rows(v: jax.Array, plan: _Plan) -> bool:
    """Whether XLA's CPU backend runs ``v``'s rows (`_CPU_FUSED_ROWS` or more) and may fuse
    their statistics into ``y``'s pass."""
    rows = v.size // int(np.prod([v.shape[a] for a in plan.axes]))
    return jax.default_backend() == "cpu" and rows >= _CPU_FUSED_ROWS


def _fused_apart(v: jax.Array, plan: _Plan) -> bool:
    """Whether the flags should read statistics of their own, so that XLA computes the
    statistics and ``y`` in one pass (it does only if nothing else reads them): for a bfloat16
    input, which sharing them makes XLA write out as float32 and read in separate passes, and
    for a float32 LayerNorm, whose two statistics and ``y`` would take three passes. A float32
    RMS statistic's shared pass (a reduction, then ``y``) costs less than a reduction more;
    float16 is not fused."""
    bfloat16 = plan.dtype == jnp.dtype(jnp.bfloat16)
    float32_layer = plan.dtype == jnp.dtype(jnp.float32) and plan.spec.kind == "layer"
    return (bfloat16 or float32_layer) and _fused_rows(v, plan)


def _separate_reads(v: jax.Array, plan: _Plan, saved: bool = False) -> bool:
    """Whether each of the forward pass's reductions over ``v``, formed from a bfloat16 input,
    should read a copy of its own (`_copies`): XLA's CPU backend then fuses the conversion into
    each, where the conversion they share is written out as a float32 array twice x's size,
    then read. Below `_CPU_FUSED_ROWS` rows (2048 x 16384, forward: 55 ms, with copies 34,
    Flax's 52), and where the statistics are ``saved`` for the backward pass (whose sums read
    copies too, `_separate_sums`). From that many rows on the forward's conversions fuse as
    they are. XLA fuses no float16 conversion into a reduction: copies gained nothing."""
    if not _compiled_for_cpu(v) or plan.dtype != jnp.dtype(jnp.bfloat16):
        return False
    return saved or not _fused_rows(v, plan)


def _separate_sums(dy: jax.Array) -> bool:
    """Whether the backward pass's sums (LayerNorm's mean, the projection, LayerNorm's sum of
    ``d``, the scale's and the bias's gradients) and its input gradient should each read copies
    of their own of the values they share (`_barrier`). XLA's CPU backend runs a reduction as a
    YNNPACK fusion, which takes a value another fusion reads too as an array written out: the
    float32 conversion of a half input, and the scale and the row statistics broadcast to x's
    shape (LayerNorm's forward+backward wrote three to six such arrays, RMSNorm's two). With
    copies each converts and broadcasts inside: at 32M elements LayerNorm's forward+backward
    ran 1.2-2.6x faster, RMSNorm's 1.05-1.8x, float16 1.13x."""
    return _compiled_for_cpu(dy)


def _compiled_for_cpu(value: jax.Array) -> bool:
    """Whether ``value`` is traced (for ``jit``, where XLA compiles the whole program) on XLA's
    CPU backend. Op by op every copy would be a computation more."""
    return isinstance(value, jax.core.Tracer) and jax.default_backend() == "cpu"


def _barrier(values: _T, count: int) -> tuple[_T, ...]:
    """``count`` copies of ``values`` through one barrier: XLA may not identify them (no CSE),
    so that each pass reading one (a reduction, or ``dx``'s) converts and broadcasts it alone."""
    return lax.optimization_barrier((values,) * count)


def _large_mean(mean: jax.Array, s: jax.Array) -> jax.Array:
    """Per row, whether ``|mean| > sqrt(s)``, or NaN: the mean's rounding, relative to
    ``|mean|``, is then more than an ulp of the centered values. Not ``mean^2 > s``: on rows
    below 1e-19 (float32) both squares flush to 0 under XLA, and ``0 > 0`` passed rows of
    1e-20 (10 + N(0, 1)) to the plain program, whose y was 1.2e-6 of max|y| off. Rows of
    zeros pass; other rows whose ``s`` flushes to 0 are flagged."""
    return ~(jnp.abs(mean) <= jnp.sqrt(s))


def _flagged(plan: _Plan, x: jax.Array, residual: jax.Array | None, reads: _Reads) -> jax.Array:
    """`_plain`'s ``careful`` from reductions of their own, each reading the inputs alone, so
    that XLA fuses each with the conversion of a half input: LayerNorm's test ``mean^2 > s`` as
    ``2 mean^2 > mean(x^2)`` (`_large_mean`), and the range of ``r`` from
    ``s = max(0, mean(x^2) - mean^2)``.
    Where they differ from the two-pass values (by roundings relative to ``mean(x^2)``),
    ``mean^2`` and ``s`` are within a few ulps of each other, where the plain program is
    accurate too."""
    first, second = _copies(plan, x, residual, 2)
    if plan.spec.kind != "layer":
        return _plain(first, plan, reads).careful
    mean = _read_mean(first, plan, reads)
    square = _read_mean(second * second, plan, reads)
    s = jnp.maximum(square - mean * mean, 0)
    return _large_mean(mean * math.sqrt(2), square) | _needs_scaling(s, plan, gradient=False)


def _copies(
    plan: _Plan, x: jax.Array, residual: jax.Array | None, count: int
) -> list[jax.Array]:
    """``count`` copies of `_added`'s ``v``, one a reduction, each formed from its own copy of
    the inputs (`_barrier`)."""
    return [_added(plan, *inputs)[0] for inputs in _barrier((x, residual), count)]


def _plain_centered(v: jax.Array, mean: jax.Array | None) -> jax.Array:
    """``c`` of the common program, for `_Plain`'s ``mean``."""
    return v if mean is None else v - mean


def _careful_only(plan: _Plan, reads: _Reads) -> bool:
    """LayerNorm rows of two (no mask, unsharded): centered as ``(x - x_other) / 2``
    (`_centered`), in the careful program only."""
    return (
        plan.spec.kind == "layer"
        and isinstance(reads.size, int)
        and reads.size == 2
        and plan.axis_name is None
    )


def _broadcast_param(
    value: jax.Array, like: jax.Array, plan: _Plan, dtype: jnp.dtype
) -> jax.Array:
    shape = [like.shape[a] if a in plan.axes else 1 for a in range(like.ndim)]
    return jnp.reshape(value, shape).astype(dtype)


def _gain(
    like: jax.Array, scale: jax.Array | None, plan: _Plan, dtype: jnp.dtype
) -> jax.Array | None:
    """``scale_offset + w`` broadcastable to ``like``, in ``dtype``; None for an effective
    scale of 1. With ``offset_dtype="param"`` the sum is rounded to ``w``'s dtype first."""
    if scale is None:
        return None
    offset = plan.spec.scale_offset
    if offset and plan.spec.offset_dtype == "param":
        return _broadcast_param(offset_in_dtype(scale, offset, jnp.float32), like, plan, dtype)
    g = _broadcast_param(scale, like, plan, dtype)
    return g + offset if offset else g


def _added(
    plan: _Plan, x: jax.Array, residual: jax.Array | None, eager: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """``(v, h)``: the values the norm reads, in the compute dtype, and ``h`` (None without a
    residual), rounded as ``spec.residual`` says.

    The sum is formed in the compute dtype and rounded (`round_to`): two half values add exactly
    in float32 (or their sum rounds to the half dtype as the exact one does). ``h`` is cast from
    the rounded sum, so that the custom VJP's backward reads it rounded even where XLA drops the
    pair of casts between the saved ``h`` and its float32 use; with ``eager`` (differentiated by
    JAX) from the sum itself, so that ``dh`` reaches the sum unrounded, as in the eager program.
    """
    compute = _stat_dtype(plan.dtype)
    if residual is None:
        return x.astype(compute), None
    total = x.astype(compute) + residual.astype(compute)
    if plan.spec.residual == "float32":
        return total, total
    rounded = round_to(total, plan.dtype)
    h = (total if eager else rounded).astype(plan.dtype)
    return (rounded if plan.spec.residual == "rounded" else total), h


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _fast_moments(plan: _Plan, v: jax.Array, reads: _Reads) -> tuple[jax.Array, jax.Array]:
    """``variance="fast"``: ``(m1, v)`` with ``m1 = c(mean(x))``, ``m2 = c(mean(c(x^2)))`` and
    ``v = max(0, c(m2 - c(m1^2)))``, the means over the elements read, each step rounded once
    (`normkit._jax_exact`; float64 inputs in plain float64). Differentiated as the two-pass
    variance: ``dv = 2 mean(c dx)``."""
    if v.dtype == jnp.float32:
        return _exact.fast_moments(v, plan.axes, reads.size, plan.axis_name, reads.where)
    m1 = _read_mean(v, plan, reads)
    return m1, jnp.maximum(_read_mean(v * v, plan, reads) - m1 * m1, 0)


@_fast_moments.defjvp
def _fast_moments_jvp(
    plan: _Plan, primals: tuple[jax.Array, _Reads], tangents: tuple[jax.Array, _Reads]
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    (v, reads), (dv, _) = primals, tangents
    m1, variance = _fast_moments(plan, v, reads)
    dvariance = 2 * _read_mean((v - m1) * dv, plan, reads)
    dm1 = _read_mean(dv, plan, reads)
    return (m1, variance), (dm1, jnp.where(variance > 0, dvariance, 0))


def _careful_y_hat(plan: _Plan, v: jax.Array, reads: _Reads) -> jax.Array:
    """``y_hat`` of the careful program: the two-pass statistic with its correction pass, rows
    rescaled where they need it (`_rows`), or the exactly rounded fast moments."""
    spec = plan.spec
    assert spec.eps is not None
    if spec.variance == "fast":
        m1, variance = _fast_moments(plan, v, reads)
        return (v - m1) * _r(variance, spec.eps, spec)
    rows = _rows(v, plan, reads)
    return rows.c * _r(rows.s, rows.eps, spec)


def _affine(
    plan: _Plan, y_hat: jax.Array, scale: jax.Array | None, bias: jax.Array | None, eager: bool
) -> jax.Array:
    """``y_hat * g + b`` in the output dtype. ``cast="before_scale"`` rounds ``y_hat`` to a
    half input's dtype first; then the affine step runs in the compute dtype, or with ``eager``
    in the eager program's dtype (`_eager_affine`)."""
    compute = y_hat.dtype
    if plan.dtype in _HALF and plan.spec.cast == "before_scale":
        y_hat = round_to(y_hat, plan.dtype)
        if eager:
            return _eager_affine(plan, y_hat, scale, bias)
    g = _gain(y_hat, scale, plan, compute)
    y = y_hat if g is None else y_hat * g
    if bias is not None:
        y = y + _broadcast_param(bias, y_hat, plan, compute)
    return y.astype(plan.out)


def _eager_affine(
    plan: _Plan, z: jax.Array, scale: jax.Array | None, bias: jax.Array | None
) -> jax.Array:
    """``z * g + b`` as eager model code computes it after the before-scale cast (``z`` rounded
    to the input dtype, held in the compute dtype): ``g`` in ``w``'s dtype (or float32 with an
    offset added there), the step in the promoted dtype ``a`` of the input, ``g`` and ``b``,
    each result rounded to ``a``.

    The arithmetic runs in float32 (at least) and rounds with `round_to`, which XLA keeps, and
    the parameters are broadcast there: this way the transposes round the gradients as the
    model says (the products of the scale's gradient to ``a``, their sum once).
    """
    g, g_dtype = None, None
    if scale is not None:
        g, g_dtype = _eager_gain(scale, plan.spec)
    affine = plan.dtype
    for dtype in (g_dtype, None if bias is None else bias.dtype):
        if dtype is not None:
            affine = jnp.promote_types(affine, dtype)
    wide = jnp.promote_types(affine, jnp.float32)

    def rounded(value: jax.Array) -> jax.Array:
        return round_to(value, affine)

    def broadcast(value: jax.Array) -> jax.Array:
        return jnp.broadcast_to(_broadcast_param(value, z, plan, wide), z.shape)

    y = z.astype(wide)
    if g is not None:
        y = rounded(y * rounded(broadcast(g)))
    if bias is not None:
        y = rounded(y + broadcast(bias))
    return y.astype(plan.out)


def _eager_gain(scale: jax.Array, spec: NormSpec) -> tuple[jax.Array, jnp.dtype]:
    """``(g, dtype)``: ``scale_offset + w`` as model code forms it, and the dtype it has there:
    ``w`` itself without an offset, the sum rounded to ``w``'s dtype with
    ``offset_dtype="param"`` (held in float32 at least), else formed in float32 (at least)."""
    if not spec.scale_offset:
        return scale, scale.dtype
    if spec.offset_dtype == "param":
        return offset_in_dtype(scale, spec.scale_offset, jnp.float32), scale.dtype
    g = scale.astype(jnp.promote_types(scale.dtype, jnp.float32)) + spec.scale_offset
    return g, g.dtype


def _forward(
    plan: _Plan, inputs: _Inputs, eager: bool, saved: bool = False
) -> tuple[_Output, _Plain | None]:
    """The output (``y``, or ``(y, h)`` with a residual) and the common program's statistics
    (`_plain`; None for DyT, and with ``eager``, which runs the careful program throughout).

    ``y`` is computed plainly, in one pass after the statistics; rows the statistics flag are
    recomputed by the careful program, inside a branch the common case skips (`_patched`).
    Where XLA would fuse the statistics and ``y`` into one pass (`_fused_apart`) and they are
    not ``saved`` for the backward pass, the flags read statistics of their own (`_flagged`)."""
    x, residual, _, scale, bias, alpha, mask = inputs
    v, h = _added(plan, x, residual, eager)
    spec = plan.spec
    plain = None
    if alpha is not None:  # dyt
        y = _affine(plan, _tanh(alpha.astype(v.dtype).reshape(()) * v), scale, bias, eager)
    else:
        assert spec.eps is not None
        reads = _reads(v, plan, mask)
        if eager or _careful_only(plan, reads):
            y = _affine(plan, _careful_y_hat(plan, v, reads), scale, bias, eager)
        else:
            apart = not saved and _fused_apart(v, plan)
            copies = (
                _copies(plan, x, residual, 2 if spec.kind == "layer" else 1)
                if _separate_reads(v, plan, saved) else ()
            )
            plain = _plain(v, plan, reads, fused=apart, copies=copies)
            y_hat = _plain_centered(v, plain.mean) * _r(plain.s, spec.eps, spec)
            careful = _flagged(plan, x, residual, reads) if apart else plain.careful

            def fix(y: jax.Array) -> jax.Array:
                # From the inputs again: a value the branch captured would be materialized.
                again = _added(plan, x, residual)[0]
                y_hat = _careful_y_hat(plan, again, _reads(again, plan, mask))
                return jnp.where(careful, _affine(plan, y_hat, scale, bias, eager), y)

            y = _patched(careful, _affine(plan, y_hat, scale, bias, eager), fix)
    return (y if h is None else (y, h)), plain


def _tanh_slope_times(u: jax.Array, d: jax.Array) -> jax.Array:
    """``d sech(u)^2``, DyT's slope from ``e^-2|u|`` (`normkit._dyt`: ``1 - tanh(u)^2`` is 0 in
    float32 from |u| = 9 on), times ``d`` before its unit, so that a normal result stays one
    where XLA flushes subnormals."""
    slope, unit = _dyt.tanh_slope(u, jnp, u.dtype == jnp.float64)
    return (d * slope) * unit


@jax.custom_jvp
def _tanh(u: jax.Array) -> jax.Array:
    """``tanh(u)``, differentiated as `_tanh_slope_times` (jnp.tanh's derivative is
    ``1 - tanh(u)^2``): DyT's ``backward="autograd"``, which JAX differentiates."""
    return jnp.tanh(u)


@_tanh.defjvp
def _tanh_jvp(
    primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    return jnp.tanh(primals[0]), _tanh_slope_times(primals[0], tangents[0])


def _run(plan: _Plan, inputs: _Inputs) -> _Output:
    """The XLA program of a spec without a gate or groups: the custom VJP, or with
    ``backward="autograd"`` the eager program JAX differentiates."""
    if plan.spec.backward == "autograd":
        return _forward(plan, inputs, eager=True)[0]
    return _norm(plan, inputs)


# --- the custom_vjp ---------------------------------------------------------------------------

_Saved = tuple[
    jax.Array,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
    jax.Array | None,
]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(plan: _Plan, inputs: _Inputs) -> _Output:
    """The forward program (`_forward`), differentiated by `_norm_bwd`."""
    return _forward(plan, inputs, eager=False)[0]


def _norm_fwd(plan: _Plan, inputs: _Inputs) -> tuple[_Output, _Saved]:
    """The output, and what the backward pass reads: the values normalized, ``s`` (None where
    the careful program alone runs, and for DyT), the parameters and the mask."""
    out, plain = _forward(plan, inputs, eager=False, saved=True)
    x, residual, _, scale, bias, alpha, mask = inputs
    # The values normalized, in the narrowest dtype that holds them: x itself, or h, or the
    # float32 sum of the float32 residual modes.
    if residual is None:
        normalized = x
    elif plan.spec.residual == "rounded":
        normalized = out[1]
    else:
        normalized = _added(plan, x, residual)[0]
    return out, (normalized, None if plain is None else plain.s, scale, bias, alpha, mask)


class _Terms(NamedTuple):
    """What the common program's backward pass reads, in the compute dtype: ``v``, ``dy``,
    ``d = dy (scale_offset + w)``, the rows (`_plain_rows`) and ``y_hat = c r``."""

    v: jax.Array
    dyf: jax.Array
    d: jax.Array
    rows: _Scaled
    y_hat: jax.Array


def _norm_bwd(plan: _Plan, saved: _Saved, cotangent: _Output) -> tuple[_Inputs]:
    """`normkit.reference.add_normalize_vjp` / `normalize_vjp`: the norm's input gradient
    (`_input_grad`), plus ``dh`` with a residual, rounded once to x's and the residual's dtypes;
    the parameters' gradients summed in the compute dtype; none for the mask. DyT
    (`_dyt_grads`), rows of two (the careful program, `_careful_grads`) and the common program
    (`_common_grads`) each compute ``(dx, dresidual, dscale)``."""
    normalized, s_saved, scale, bias, alpha, mask = saved
    dy, dh = cotangent if plan.residual_dtype is not None else (cotangent, None)
    bwd = _Backward(plan, normalized, cast(jax.Array, dy), dh, scale, mask)
    prepared = bwd.prepared(normalized, bwd.dy, scale)
    dalpha = None
    dyf_bias = prepared[1]
    if alpha is not None:
        dx, dresidual, dscale, dalpha = _dyt_grads(bwd, prepared, alpha)
    elif s_saved is None:  # rows of two: the careful program only
        dx, dresidual, dscale = _careful_grads(bwd, prepared)
    else:
        dx, dresidual, dscale, dyf_bias = _common_grads(bwd, prepared, s_saved)
    dbias = None if bias is None else jnp.sum(dyf_bias, axis=bwd.batch).astype(bias.dtype)
    return (_Inputs(dx, dresidual, None, dscale, dbias, dalpha, None),)


_Prepared = tuple[jax.Array, jax.Array, jax.Array]
_Grads = tuple[jax.Array, jax.Array | None, jax.Array | None]


class _Backward(NamedTuple):
    """The backward pass's inputs: the values normalized (x, or h), the cotangents ``dy`` and
    ``dh`` (None without a residual), the scale and the mask."""

    plan: _Plan
    normalized: jax.Array
    dy: jax.Array
    dh: jax.Array | None
    scale: jax.Array | None
    mask: jax.Array | None

    @property
    def compute(self) -> jnp.dtype:
        return _stat_dtype(self.plan.dtype)

    @property
    def batch(self) -> tuple[int, ...]:
        """The axes the parameters' gradients are summed over."""
        return tuple(a for a in range(self.normalized.ndim) if a not in self.plan.axes)

    def prepared(
        self, normalized: jax.Array, dy: jax.Array, scale: jax.Array | None
    ) -> _Prepared:
        """``(v, dy, d)`` in the compute dtype, ``d = dy (scale_offset + w)``, from the values
        normalized, the cotangent and the scale (these or copies of them)."""
        v = normalized.astype(self.compute)
        dyf = dy.astype(self.compute)
        g = _gain(v, scale, self.plan, self.compute)
        return v, dyf, (dyf if g is None else dyf * g)

    def terms(self, prepared: _Prepared, mean: jax.Array | None, s: jax.Array) -> _Terms:
        """What the common program's sums and input gradient read (`_Terms`), from `prepared`'s
        values and the row statistics (or copies of them)."""
        eps = self.plan.spec.eps
        assert eps is not None
        rows = _plain_rows(prepared[0], mean, s, eps)
        return _Terms(*prepared, rows, rows.c * _r(s, eps, self.plan.spec))

    def scale_grad(self, dyf: jax.Array, y_hat: jax.Array) -> jax.Array | None:
        """``dw = sum dy y_hat`` over the batch axes (None without a scale)."""
        if self.scale is None:
            return None
        return jnp.sum(dyf * y_hat, axis=self.batch).astype(self.scale.dtype)

    def rounded(self, dv: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """``(dx, dresidual)`` in their dtypes: the norm's gradient ``dv``, plus ``dh`` with a
        residual, rounded once (elementwise, so a branch may round before it picks rows)."""
        if self.plan.residual_dtype is None:
            return dv.astype(self.plan.dtype), None
        assert self.dh is not None
        total = dv + self.dh.astype(self.compute)
        return total.astype(self.plan.dtype), total.astype(self.plan.residual_dtype)

    def careful_input_grad(self, v: jax.Array, d: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(dv, y_hat)`` of the careful program: the rows rescaled where the gradient needs
        it (`_rows`), the sums in units of ``d``'s size (`_input_grad`)."""
        reads = _reads(v, self.plan, self.mask)
        return _input_grad(self.plan, _rows(v, self.plan, reads, gradient=True), d, reads)


def _dyt_grads(
    bwd: _Backward, prepared: _Prepared, alpha: jax.Array
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array]:
    """DyT: ``y_hat = tanh(alpha v)``, whose slope is ``sech(alpha v)^2``: ``dv = alpha d
    sech^2``, ``dalpha = sum d sech^2 v``; and ``dscale``."""
    v, dyf, d = prepared
    a = alpha.astype(bwd.compute).reshape(())
    u = a * v
    y_hat = jnp.tanh(u)
    sloped = _tanh_slope_times(u, d)
    dx, dresidual = bwd.rounded(a * sloped)
    dalpha = jnp.sum(sloped * v).reshape(alpha.shape).astype(alpha.dtype)
    return dx, dresidual, bwd.scale_grad(dyf, y_hat), dalpha


def _careful_grads(bwd: _Backward, prepared: _Prepared) -> _Grads:
    """Every row through the careful program (`_Backward.careful_input_grad`)."""
    v, dyf, d = prepared
    dv, y_hat = bwd.careful_input_grad(v, d)
    return (*bwd.rounded(dv), bwd.scale_grad(dyf, y_hat))


def _common_grads(
    bwd: _Backward, prepared: _Prepared, s_saved: jax.Array
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array]:
    """The common program's ``(dx, dresidual, dscale)`` and the ``dy`` the bias's gradient
    sums, from the saved ``s`` (LayerNorm's mean computed again): the row sums
    (`_row_projection`), the input gradient (`_input_grad`), and the rows they cannot serve
    recomputed by the careful program inside a branch the common case skips (`_patched`)."""
    plan = bwd.plan
    v, dyf, d = prepared
    reads = _reads(v, plan, bwd.mask)
    copies = _separate_sums(bwd.dy)
    # LayerNorm's mean computed again (from a copy of its own, as each sum below reads one).
    layer = plan.spec.kind == "layer"
    mean_copy = [_barrier(bwd.normalized, 1)[0].astype(bwd.compute)] if copies and layer else []
    plain = _plain(v, plan, reads, s_saved, copies=mean_copy)
    # Rows the statistics cannot serve: those the forward flagged, and with eps outside
    # those whose s is too small for the gradient.
    careful = plain.careful | _needs_scaling(plain.s, plan, gradient=True)
    # The four sums over the rows and columns (the projection, LayerNorm's sum of d, the
    # scale's and the bias's gradients) and the input gradient each read copies of their own
    # of the residuals, the cotangent, the scale and the statistics where
    # `_separate_sums` says so.
    if copies:
        inputs = (bwd.normalized, bwd.dy, bwd.scale, plain.mean, plain.s)
        each = [bwd.terms(bwd.prepared(*c[:3]), *c[3:]) for c in _barrier(inputs, 5)]
    else:
        each = [bwd.terms(prepared, plain.mean, plain.s)] * 5
    projected, d_summed, scaled, biased, applied = each
    projection, d_sum = _row_projection(plan, plain, projected, d_summed)
    # Rows where it overflows (|x| and dy both large; a huge value a mask leaves out,
    # unbounded by the row's scale), or where its products by y_hat_i may, go to the
    # careful program, which sums it in units of d's size.
    careful |= ~(jnp.abs(projection) < _PROJECTION_LIMIT)
    dv, _ = _input_grad(plan, applied.rows, applied.d, reads, projection, d_sum)

    def fix(grads: _Grads) -> _Grads:
        # From the residuals again: a value the branch captured would be materialized.
        v, dyf, d = bwd.prepared(bwd.normalized, bwd.dy, bwd.scale)
        dv, y_hat = bwd.careful_input_grad(v, d)
        y_hat_plain = bwd.terms((v, dyf, d), plain.mean, plain.s).y_hat
        dscale = bwd.scale_grad(dyf, jnp.where(careful, y_hat, y_hat_plain))
        dx, dresidual = bwd.rounded(dv)
        plain_dx, plain_dresidual = grads[:2]
        if dresidual is not None and plain_dresidual is not None:
            dresidual = jnp.where(careful, dresidual, plain_dresidual)
        return jnp.where(careful, dx, plain_dx), dresidual, dscale

    # The gradients pass the branch in their own dtypes: rounding after it is a pass more.
    grads = _patched(careful, (*bwd.rounded(dv), bwd.scale_grad(scaled.dyf, scaled.y_hat)), fix)
    return (*grads, biased.dyf)


def _row_projection(
    plan: _Plan, plain: _Plain, projected: _Terms, d_summed: _Terms
) -> tuple[jax.Array, jax.Array | None]:
    """Per row, ``sum_j d_j y_hat_j`` (RMS kinds: as ``r sum_j d_j x_j``) and LayerNorm's
    ``sum_j d_j`` (None for the RMS kinds), each from its own `_Terms`."""
    if plain.mean is None:
        assert plan.spec.eps is not None
        r = _r(plain.s, plan.spec.eps, plan.spec)
        return r * _row_sum(projected.d * projected.v, plan), None
    return _row_sum(projected.d * projected.y_hat, plan), _row_sum(d_summed.d, plan)


# The largest projection sum_j d_j y_hat_j the common program uses: its products by y_hat_i
# (at most sqrt(n) on the elements read) stay finite.
_PROJECTION_LIMIT = 2.0**100


def _cotangent_unit(d: jax.Array, plan: _Plan, n: int) -> jax.Array:
    """Per row, the power of two ``2**-e`` that puts ``d``'s largest magnitude below
    ``n**-2``: in those units no term of ``r sum_j d_j c_j`` (``|c_j|`` up to float32's
    largest, ``r`` up to ``sqrt(n)`` in scaled units), no partial sum and no product by a
    ``y_hat_i`` read (at most ``sqrt(n)``) overflows. ``e`` is clamped to [-125, 125], so that
    ``2**-e`` and ``2**e`` are normal."""
    _, exponent = jnp.frexp(_row_max(jnp.abs(d), plan))
    e = jnp.clip(exponent + 2 * math.ceil(math.log2(max(n, 2))), -125, 125)
    return jnp.ldexp(jnp.ones(e.shape, d.dtype), -e)


def _plain_rows(v: jax.Array, mean: jax.Array | None, s: jax.Array, eps: float) -> _Scaled:
    """The rows of the common program (`_Plain`'s ``mean`` and ``s``), as `_input_grad` takes
    them (unscaled)."""
    one = jnp.ones((), v.dtype)
    return _Scaled(_plain_centered(v, mean), s, jnp.full_like(s, eps), one, one)


def _input_grad(
    plan: _Plan,
    rows: _Scaled,
    d: jax.Array,
    reads: _Reads,
    projection: jax.Array | None = None,
    d_sum: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(dv, y_hat)``: the gradients of `normkit.reference.normalize_vjp` for
    ``d = dy (scale_offset + w)``, in terms of ``y_hat = c r`` of ``rows`` (the two-pass
    statistic; the fast variance has its gradient).

    With ``z = y_hat`` (inside) or ``c / sqrt(s)`` (outside, 0 where s = 0; scale-free, taken
    in scaled units), R the K elements the statistic reads (the mask's, partial RMS's first k,
    or all n) and the sums over the whole row::

        dx_i = r (d_i - [i in R] ([layer] sum_j d_j + z_i sum_j d_j y_hat_j) / K)

    No intermediate leaves the dtype's range (``r**3`` would). Where R holds one element (RMS
    kinds) or two (LayerNorm), the part of the sums over R cancels, to ``rest (d_i - [layer]
    mean_R(d))`` with ``rest = 1 - z_i y_hat_i = eps r**2`` (inside) or ``eps r`` (outside),
    taken in that closed form; the part over the other elements is added as it is.
    ``projection`` is ``sum_j d_j y_hat_j`` per row and ``d_sum`` LayerNorm's ``sum_j d_j``,
    where the caller has formed them (the common program, whose rows keep ``projection``
    below `_PROJECTION_LIMIT`); without them (the careful program) ``d`` is taken in units of
    `_cotangent_unit`, where no sum or product overflows that the result does not.
    """
    spec = plan.spec
    r = _r(rows.s, rows.eps, spec)
    y_hat = rows.c * r
    unit = None
    if projection is None:
        unit = _cotangent_unit(d, plan, _row_size(d, plan))
        d = d * unit
    z, rest = _slope_terms(rows, r, y_hat, spec)
    layer = spec.kind == "layer"

    def projected(where: jax.Array | None = None) -> jax.Array:
        """``sum_j d_j y_hat_j`` (over ``where``); in the careful program's units as
        ``r sum_j d_j c_j``: a value the statistic does not read (a mask's) is unbounded by the
        row's scale, and its ``y_hat`` may exceed float32's range where its terms do not."""
        if unit is None:
            return _row_sum(d * y_hat, plan, where)
        return r * _row_sum(d * rows.c, plan, where)

    if projection is None:
        projection = projected()
    k = reads.size

    def on_reads(value: jax.Array) -> jax.Array:
        """``value`` on the elements read, ``d`` elsewhere."""
        return value if reads.where is None else jnp.where(reads.where, value, d)

    def general() -> jax.Array:
        total = (_row_sum(d, plan) if d_sum is None else d_sum) if layer else 0
        return on_reads(d - (total + z * projection) / k)

    def closed() -> jax.Array:
        value = (d - (_read_mean(d, plan, reads) if layer else 0)) * rest
        if reads.where is not None:  # the part of the sums over the other elements
            others = ~reads.where
            d_others = _row_sum(d, plan, others) if layer else 0
            value -= (d_others + z * projected(others)) / k
        return on_reads(value)

    degenerate = k == (2 if layer else 1)
    if isinstance(k, int):  # no mask: every row reads as many elements
        inner = closed() if degenerate else general()
    else:
        inner = jnp.where(degenerate, closed(), general())
    if unit is not None:
        inner = inner * (1 / unit)
    return r * inner * rows.sigma * rows.pre, y_hat



def _slope_terms(
    rows: _Scaled, r: jax.Array, y_hat: jax.Array, spec: NormSpec
) -> tuple[jax.Array, jax.Array]:
    """``(z, rest)`` of `_input_grad`: ``z = y_hat`` (inside) or ``c / sqrt(s)`` (outside, 0
    where s = 0), what the projection is applied with, and the closed form of ``rest = 1 - z_i
    y_hat_i`` on a row of one element read: ``eps r**2`` (inside) or ``eps r`` (outside)."""
    if spec.eps_placement == "outside":
        positive = rows.s > 0
        z = rows.c * jnp.where(positive, 1 / jnp.sqrt(jnp.where(positive, rows.s, 1)), 0)
        return z, rows.eps * r
    return y_hat, rows.eps * r * r

_norm.defvjp(_norm_fwd, _norm_bwd)
