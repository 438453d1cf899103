"""The conformance hook: run a normkit.jax layer on numpy inputs, forward and backward.

float64 cases run with JAX's 64-bit mode enabled only for the duration of `evaluate` (the
scoped ``jax.enable_x64`` context), so they are computed and returned in float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

import normkit.jax as nkjax
from normkit import reference
from normkit.bridges import JaxBridge
from normkit.conformance.targets import check_variant
from normkit.jax import functional
from normkit.spec import NormSpec

__all__ = ["APIS", "VARIANTS", "devices", "evaluate"]

Api = Literal["linen", "nnx", "functional"]
APIS: tuple[Api, ...] = ("linen", "nnx", "functional")
VARIANTS: dict[str, tuple[object, ...] | None] = {"api": APIS, "jit": (True, False)}

# (x, residual or None, params) -> y, or (y, h) with a residual
Apply = Callable[[jax.Array, jax.Array | None, dict[str, jax.Array]], Any]

_BRIDGE = JaxBridge()
devices = _BRIDGE.devices


def evaluate(
    spec: NormSpec,
    x: np.ndarray,
    dy: np.ndarray,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    residual: np.ndarray | None = None,
    dh: np.ndarray | None = None,
    alpha: np.ndarray | None = None,
    device: str = "cpu",
    **variant: Any,
) -> tuple[np.ndarray | None, ...]:
    """``spec``'s layer applied to ``x`` on ``device`` under ``jax.jit``, and its VJP.

    Args:
      spec: the norm.
      x: the input, float16, bfloat16, float32 or float64.
      dy: the output cotangent, of ``x``'s shape and dtype (cast to the output's).
      scale: ``w`` in the parameter dtype; None: the layer's initial value, in the dtype of the
        parameters given (float32 without any).
      bias: ``b``; None: zeros, likewise.
      residual: with ``spec.residual`` (and only then): the residual, of ``x``'s shape.
      dh: with ``spec.residual``: the cotangent of ``h``, in ``h``'s dtype.
      alpha: for ``kind="dyt"``: ``alpha``, shape ``(1,)``; None: ``spec.alpha_init``.
      device: one of `devices` (``gpu:N`` is read as ``cuda:N``).
      variant: ``api=`` ``"linen"`` (`normkit.jax.from_spec`, the default), ``"nnx"``
        (`normkit.jax.nnx.from_spec`) or ``"functional"`` (`normkit.jax.functional.normalize`
        and ``add_norm``); ``jit=False`` runs eagerly (default True).

    Returns:
      ``(y, dx, dscale, dbias)``, then ``(h, dresidual)`` with a residual, then ``(dalpha,)``
      for DyT (`normkit.conformance.compare.quantities`), as numpy arrays in the dtypes JAX
      produced; None for a parameter the spec lacks.
    """
    check_variant(variant, VARIANTS)
    api: Api = variant.get("api", "linen")
    x, dy = np.asarray(x), np.asarray(dy)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(
            f"dy has shape {dy.shape} and dtype {dy.dtype}; expected x's, {x.shape} and {x.dtype}"
        )
    given = "residual" if residual is not None else "dh" if dh is not None else None
    if spec.residual is not None and (residual is None or dh is None):
        raise ValueError(f"the spec has residual={spec.residual!r}: evaluate needs residual and dh")
    if spec.residual is None and given is not None:
        raise ValueError(f"{given} was given but the spec has residual=None")
    target = _BRIDGE.device(device)
    reference.check_params(x.shape, spec, scale, bias)
    params = _params(spec, x.shape, scale, bias, alpha)
    arrays = [x, *params.values()] + ([] if residual is None else [np.asarray(residual)])
    wide = any(np.asarray(a).dtype == np.float64 for a in arrays)
    x64 = jax.enable_x64(True) if wide else contextlib.nullcontext()
    with x64:
        apply = _apply_fn(spec, spec.param_shape(x.shape), params, api)
        run = _vjp(apply, residual is not None)
        if variant.get("jit", True):
            run = jax.jit(run)
        extra = () if residual is None else (residual, dh)
        outputs = run(*jax.device_put((x, params, dy, *extra), target))
        return tuple(None if a is None else np.asarray(a) for a in _ordered(spec, outputs))


def _params(
    spec: NormSpec,
    shape: tuple[int, ...],
    scale: np.ndarray | None,
    bias: np.ndarray | None,
    alpha: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """Every parameter the spec has, as given or at its initial value in the dtype of those
    given (float32 without any)."""
    if alpha is not None:
        if spec.kind != "dyt":
            raise ValueError(f"alpha was given but the spec has kind={spec.kind!r} (not 'dyt')")
        if np.shape(alpha) != (1,):
            raise ValueError(f"alpha has shape {np.shape(alpha)}, expected (1,)")
    given = [np.asarray(v) for v in (scale, bias, alpha) if v is not None]
    dtype = given[0].dtype if given else np.dtype(np.float32)
    pshape = spec.param_shape(shape)
    params: dict[str, np.ndarray] = {}
    for name, value, present, init, size in (
        ("scale", scale, spec.scale, spec.scale_init, pshape),
        ("bias", bias, spec.bias, 0.0, pshape),
        ("alpha", alpha, spec.kind == "dyt", spec.alpha_init, (1,)),
    ):
        if present:
            params[name] = np.full(size, init, dtype) if value is None else np.asarray(value)
    return params


def _vjp(apply: Apply, with_residual: bool) -> Callable[..., Any]:
    """``(x, params, dy[, residual, dh]) -> (y, dx, dparams[, h, dresidual])``."""

    def plain(x: jax.Array, params: Any, dy: jax.Array) -> tuple[Any, ...]:
        y, pullback = jax.vjp(lambda x, p: apply(x, None, p), x, params)
        dx, dparams = pullback(dy.astype(y.dtype))
        return y, dx, dparams

    def added(
        x: jax.Array, params: Any, dy: jax.Array, residual: jax.Array, dh: jax.Array
    ) -> tuple[Any, ...]:
        (y, h), pullback = jax.vjp(apply, x, residual, params)
        dx, dresidual, dparams = pullback((dy.astype(y.dtype), dh.astype(h.dtype)))
        return y, dx, dparams, h, dresidual

    return added if with_residual else plain


def _ordered(spec: NormSpec, outputs: tuple[Any, ...]) -> list[Any]:
    """The outputs in the order of `normkit.conformance.compare.quantities`."""
    y, dx, dparams = outputs[:3]
    found = [y, dx, dparams.get("scale"), dparams.get("bias"), *outputs[3:]]
    if spec.kind == "dyt":
        found.append(dparams["alpha"])
    return found


def _apply_fn(
    spec: NormSpec, shape: tuple[int, ...], params: dict[str, np.ndarray], api: Api
) -> Apply:
    """``(x, residual, params) -> y or (y, h)`` for ``api``; ``params`` a dict of arrays named
    ``scale``, ``bias``, ``alpha``."""
    param_dtype = next(iter(params.values())).dtype if params else np.dtype(np.float32)
    if api == "functional":

        def apply_functional(x: jax.Array, residual: jax.Array | None, p: dict[str, Any]) -> Any:
            args = (spec, p.get("scale"), p.get("bias"))
            if residual is None:
                return functional.normalize(x, *args, alpha=p.get("alpha"))
            return functional.add_norm(x, residual, *args, alpha=p.get("alpha"))

        return apply_functional
    if api == "linen":
        module = nkjax.from_spec(spec, param_dtype=param_dtype)

        def apply_linen(x: jax.Array, residual: jax.Array | None, p: dict[str, Any]) -> Any:
            return module.apply({"params": p}, x, residual)

        return apply_linen
    graphdef = nnx.graphdef(nkjax.nnx.from_spec(spec, shape, param_dtype=param_dtype))

    def apply_nnx(x: jax.Array, residual: jax.Array | None, p: dict[str, Any]) -> Any:
        state = nnx.State({name: nnx.Param(value) for name, value in p.items()})
        return nnx.merge(graphdef, state)(x, residual)

    return apply_nnx
