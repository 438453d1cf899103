"""A conformance hook written once: a framework function checked on numpy inputs, through its
framework's bridge, forward and backward.

Every hook (`normkit.conformance.targets.Hook`) is a `Harness`: what differs between targets is
only ``build(spec, shape, param_dtype, *, dtype, device, **variant) -> fn``, the function
``fn(x[, residual], **params) -> y`` or ``(y, h)`` of one layer, and the bridge that takes its
VJP (`normkit.bridges.Bridge.vjp`). The harness validates the inputs, gives the parameters a
case leaves out their initial values from the spec, and returns the outputs in the order of
`normkit.conformance.compare.quantities`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from normkit import reference
from normkit.bridges import Bridge, VjpFn, device_name
from normkit.conformance.compare import Inputs, param_dtype
from normkit.conformance.targets import HookOutputs, check_variant
from normkit.identify import Identification
from normkit.identify import identify as identify_function
from normkit.spec import NormSpec

__all__ = ["Build", "Harness", "initial_params", "check_inputs"]

Build = Callable[..., VjpFn]
"""``build(spec, shape, param_dtype, *, dtype, device, **variant) -> fn``: the function of
``spec``'s layer for inputs of ``shape`` and ``dtype`` on ``device``, parameters of
``param_dtype``; ``fn(x[, residual or gate], **params)`` with params named ``scale``, ``bias``,
``alpha`` (those the spec has). A layer's ``fn`` carries the parameters a fresh layer holds as
``fn.initial_params`` (numpy, by those names): a case that leaves a parameter out
(`normkit.conformance.cases.Case.initial`) is run with them. It raises NotImplementedError for
a case the layer cannot run (a SKIP), ValueError for a variant that does not apply."""


def check_inputs(spec: NormSpec, inputs: Inputs) -> None:
    """ValueError unless the case's arrays fit the spec: ``dy`` of x's shape, ``residual`` and
    ``dh`` exactly when the spec has a residual and ``gate`` exactly when it has one (each of
    x's shape), ``alpha`` only for DyT (shape ``(1,)``), and ``scale`` and ``bias`` as
    `normkit.reference.check_params` asks (None: not given)."""
    x, dy, scale, bias, residual, dh, alpha, gate = inputs
    if np.shape(dy) != np.shape(x):
        raise ValueError(f"dy has shape {np.shape(dy)}, expected the shape of x, {np.shape(x)}")
    if (residual is None) != (spec.residual is None) or (dh is None) != (spec.residual is None):
        raise ValueError(
            f"residual and dh are given exactly when the spec has a residual; the spec has "
            f"residual={spec.residual!r}, residual given: {residual is not None}, dh given: "
            f"{dh is not None}"
        )
    if (gate is None) != (spec.gate is None):
        raise ValueError(
            f"a gate is given exactly when the spec has one; the spec has gate={spec.gate!r}, "
            f"gate given: {gate is not None}"
        )
    for name, value in (("residual", residual), ("dh", dh), ("gate", gate)):
        if value is not None and np.shape(value) != np.shape(x):
            raise ValueError(
                f"{name} has shape {np.shape(value)}, expected the shape of x, {np.shape(x)}"
            )
    if alpha is not None:
        if spec.kind != "dyt":
            raise ValueError(f"alpha was given but the spec has kind={spec.kind!r} (not 'dyt')")
        if np.shape(alpha) != (1,):
            raise ValueError(f"alpha has shape {np.shape(alpha)}, expected (1,)")
    reference.check_params(np.shape(x), spec, scale, bias)


def initial_params(
    spec: NormSpec, inputs: Inputs, own: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Every parameter the spec has, by name (``scale``, ``bias``, ``alpha``): as given, or the
    layer's ``own`` initial value where it has one (the values a fresh layer holds, so that
    its initialization is checked), else the spec's (``scale_init``, 0, ``alpha_init``) in
    `param_dtype`."""
    dtype = param_dtype(inputs)
    param_shape = spec.param_shape(np.shape(inputs.x))
    params: dict[str, np.ndarray] = {}
    for name, value, present, init, size in (
        ("scale", inputs.scale, spec.scale, spec.scale_init, param_shape),
        ("bias", inputs.bias, bool(spec.bias), 0.0, param_shape),
        ("alpha", inputs.alpha, spec.kind == "dyt", spec.alpha_init, (1,)),
    ):
        if not present:
            continue
        if value is not None:
            params[name] = np.asarray(value)
        elif own is not None and name in own:
            params[name] = np.asarray(own[name]).astype(dtype).reshape(size)
        else:
            params[name] = np.full(size, init, dtype)
    return params


class Harness:
    """A target's hook: ``devices()`` and ``evaluate(...)`` over ``build`` and ``bridge``.

    Args:
      bridge: the framework's bridge, which takes the VJP.
      build: the target's `Build`.
      variants: the variant keywords ``evaluate`` takes, with their allowed values (None: any).
      jit: whether the VJP is compiled as one program when the variant names no ``jit``.
      devices: the devices the target runs on (default: the bridge's).
    """

    def __init__(
        self,
        bridge: Bridge,
        build: Build,
        variants: Mapping[str, tuple[object, ...] | None],
        *,
        jit: bool = False,
        devices: Callable[[], list[str]] | None = None,
    ) -> None:
        self.bridge = bridge
        self.build = build
        self.variants = variants
        self.jit = jit
        self.devices = devices or bridge.devices

    def identify(self, *, n: int = 64, device: str = "cpu", **variant: Any) -> Identification:
        """What the layer ``build`` gives for ``variant`` computes on rows of ``n``
        (`normkit.identify.identify`, with its parameters): for a peer, whose layer is what it
        is whatever the spec, so ``build`` is asked with the default one."""
        check_variant(variant, self.variants)
        float32 = np.dtype(np.float32)
        fn = self.build(NormSpec(), (n,), float32, dtype=float32, device=device_name(device),
                        **variant)
        return identify_function(fn, (n,), backend=self.bridge.name, params=True, device=device)

    def evaluate(
        self,
        spec: NormSpec,
        x: np.ndarray,
        dy: np.ndarray,
        scale: np.ndarray | None = None,
        bias: np.ndarray | None = None,
        *,
        residual: np.ndarray | None = None,
        dh: np.ndarray | None = None,
        alpha: np.ndarray | None = None,
        gate: np.ndarray | None = None,
        device: str = "cpu",
        **variant: Any,
    ) -> HookOutputs:
        """The target's ``(y, dx, dscale, dbias)``, then ``(dgate,)`` with a gate,
        ``(h, dresidual)`` with a residual, then ``(dalpha,)`` for DyT, as numpy arrays in the
        dtypes it produced (None for a parameter the spec lacks): the backward of
        ``sum(dy * y) + sum(dh * h)``.

        The contract is `normkit.conformance.targets.Hook`'s: ``scale``, ``bias``, ``alpha``
        None take their initial values, in the dtype of the parameters given (float32 without
        any); ``device`` one of `devices` (``gpu:N`` is read as ``cuda:N``).
        """
        check_variant(variant, self.variants)
        given, device = device, device_name(device)
        x, dy = np.asarray(x), np.asarray(dy)
        inputs = Inputs(x, dy, scale, bias, residual, dh, alpha, gate)
        check_inputs(spec, inputs)
        # built first: a target that cannot run on a device says so (a SKIP) wherever it runs
        fn = self.build(
            spec, x.shape, param_dtype(inputs), dtype=x.dtype, device=device, **variant
        )
        params = initial_params(spec, inputs, getattr(fn, "initial_params", None))
        seen = self.devices()
        if device not in seen:
            raise ValueError(f"device {given!r} is not one {self.bridge.name} sees: {seen}")
        primals: tuple[np.ndarray, ...] = (x,)
        cotangents: tuple[np.ndarray, ...] = (dy,)
        if residual is not None and dh is not None:
            primals, cotangents = (x, np.asarray(residual)), (dy, np.asarray(dh))
        if gate is not None:  # fn(x, gate): a second input, no second output
            primals = (x, np.asarray(gate))
        jit = bool(variant.get("jit", self.jit))
        outputs, dprimals, dparams = self.bridge.vjp(
            fn, primals, cotangents, params, device, jit=jit
        )
        ordered = [outputs[0], dprimals[0], dparams.get("scale"), dparams.get("bias")]
        if spec.gate is not None:
            ordered.append(dprimals[1])
        if spec.residual is not None:
            ordered += [outputs[1], dprimals[1]]
        if spec.kind == "dyt":
            ordered.append(dparams["alpha"])
        return tuple(ordered)
