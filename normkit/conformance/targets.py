"""The registry of implementations conformance runs: normkit's adapters (the frameworks' built-in
layers, the peers, are in `normkit.conformance.peers`), and the contract of their hooks.

A target names the normkit backends it needs (`normkit.backends`: packages, install hint and
worker environment derive from them), a hook module that satisfies `Hook`, and the variant its
``evaluate`` takes. Adding an implementation is one line in `TARGETS`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from normkit import backends
from normkit.spec import NormSpec

HookOutputs = tuple[np.ndarray | None, ...]
"""What `Hook.evaluate` returns: numpy arrays named, in order, by
`normkit.conformance.compare.quantities` (``y, dx, dscale, dbias``, then ``h, dresidual`` with a
residual, then ``dalpha`` for DyT), in the dtypes the implementation produced; None for a
parameter the spec lacks."""


class Hook(Protocol):
    """What a target's hook module provides (``normkit.conformance.targets_torch``, ...): a
    `normkit.conformance.harness.Harness`'s ``devices`` and ``evaluate``.

    ``VARIANTS`` names the variant keywords ``evaluate`` takes, with their allowed values (None:
    any value, passed through to the implementation). ``evaluate`` raises NotImplementedError
    for a case the implementation does not support (a SKIP; only where the framework truly
    cannot, e.g. float64 on a device without it, saying why); any other exception is a FAIL.

    The contract of ``evaluate(spec, x, dy, scale, bias, *, residual, dh, alpha, device,
    **variant)``:

    - ``x`` and ``dy`` (the cotangent of ``y``) in the case dtype; ``scale``, ``bias`` in the
      parameter dtype, or None for the layer's initial value (float32 parameters then).
    - ``residual`` and ``dh`` are given exactly when ``spec.residual`` is set: ``residual`` of
      x's shape and dtype, ``dh`` the cotangent of ``h`` in h's dtype (float32 for
      ``residual="float32"`` with a half x, else x's). The backward is that of
      ``sum(dy * y) + sum(dh * h)``.
    - ``alpha`` (DyT only): shape ``(1,)`` in the parameter dtype, or None for ``alpha_init``;
      ``dalpha`` comes back with alpha's shape and dtype.
    - Returns `HookOutputs`: a spec without a residual and not DyT gets today's 4-tuple.
    """

    VARIANTS: Mapping[str, tuple[object, ...] | None]

    def devices(self) -> list[str]: ...

    def evaluate(
        self, spec: NormSpec, x: np.ndarray, dy: np.ndarray, scale: np.ndarray | None = None,
        bias: np.ndarray | None = None, *, residual: np.ndarray | None = None,
        dh: np.ndarray | None = None, alpha: np.ndarray | None = None, device: str = "cpu",
        **variant: Any,
    ) -> HookOutputs: ...


def check_variant(
    variant: Mapping[str, object], allowed: Mapping[str, tuple[object, ...] | None]
) -> None:
    """ValueError naming a variant keyword or value that ``allowed`` (a hook's VARIANTS) lacks."""
    unknown = sorted(set(variant) - set(allowed))
    if unknown:
        raise ValueError(f"unknown variant options {unknown}; allowed: {sorted(allowed)}")
    for key, value in variant.items():
        values = allowed[key]
        if values is not None and value not in values:
            raise ValueError(f"{key}={value!r} is invalid: expected one of {list(values)}")


@dataclass(frozen=True)
class Target:
    """One implementation to check.

    Attributes:
      name: shown in reports, e.g. ``"jax.nnx"`` or ``"tf[jax]"``.
      backends: the normkit backends (`normkit.backends`) it needs installed.
      hook: the module (a `Hook`) with ``devices`` and ``evaluate``.
      variant: keyword arguments for ``evaluate``.
      env: environment variables for the worker process, over the backends' own.
      packages: packages needed beyond the backends' (e.g. ``transformers``).
      claims: for a peer, the NormSpec the built-in layer appears to implement; its cases use it.
      params_in_input_dtype: for a peer, whether its parameters are kept in the input's dtype
        (torch's ``module.to(dtype)``) rather than float32.
      note: what the target is, for the report.
      cost: the time a case takes, relative to the eager ``torch`` target's (measured on the
        2-core machine of docs/benchmarks.md): the progress display's estimate of the time left
        weighs each case by it.
    """

    name: str
    backends: tuple[str, ...]
    hook: str
    variant: Mapping[str, object] = field(default_factory=dict, hash=False)
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    packages: tuple[str, ...] = ()
    claims: NormSpec | None = None
    params_in_input_dtype: bool = False
    note: str = ""
    cost: float = 1.0

    @property
    def requires(self) -> tuple[str, ...]:
        """Every package it needs."""
        found = [p for b in self.backends for p in backends.get(b).packages]
        return tuple(dict.fromkeys([*found, *self.packages]))

    @property
    def install(self) -> str:
        """The command that installs what it needs."""
        return backends.install_hint([backends.get(b).extra for b in self.backends], self.packages)

    @property
    def environment(self) -> dict[str, str]:
        """The worker's environment variables: the backends', then the target's own."""
        found: dict[str, str] = {}
        for b in self.backends:
            found.update(backends.get(b).env)
        return {**found, **self.env}

    def missing(self) -> str | None:
        """Why this target cannot run here (a package is not installed), or None."""
        missing = [p for p in self.requires if importlib.util.find_spec(p) is None]
        if missing:
            return f"{', '.join(missing)} not installed ({self.install})"
        return None


TORCH_HOOK = "normkit.conformance.targets_torch"
KERAS_HOOK = "normkit.conformance.targets_keras"
JAX_HOOK = "normkit.conformance.targets_jax"


def _torch(
    name: str,
    note: str,
    packages: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
    *,
    cost: float = 1.0,
    **variant: object,
) -> Target:
    """A normkit.torch target; ``variant`` as the hook's VARIANTS (``api``, ``kernel``, ...)."""
    return Target(
        name, ("torch",), TORCH_HOOK, variant, env or {}, packages, note=note, cost=cost
    )


def _keras(keras_backend: str, cost: float, **variant: object) -> Target:
    """normkit.tf on one Keras backend: on JAX or torch it needs Keras and that framework, not
    TensorFlow."""
    jit = ",jit" if variant.get("jit") else ""
    # Keras on JAX needs jax itself, not the jax backend's flax
    needs = {"tensorflow": ("tf",), "jax": (), "torch": ("torch",)}[keras_backend]
    packages = {"tensorflow": (), "jax": ("keras", "jax"), "torch": ("keras",)}[keras_backend]
    return Target(
        f"tf[{keras_backend}{jit}]",
        needs,
        KERAS_HOOK,
        variant,
        {"KERAS_BACKEND": keras_backend},
        packages,
        note=f"normkit.tf on the {keras_backend} Keras backend" + (" under jit" if jit else ""),
        cost=cost,
    )


def _jax(api: str, cost: float) -> Target:
    return Target(
        f"jax.{api}", ("jax",), JAX_HOOK, {"api": api}, note=f"normkit.jax {api}, jitted",
        cost=cost,
    )


LEAN_COST = 10.0
"""A target whose case costs this many times the eager torch target's compiles each program
(XLA, Triton's interpreter): in the default matrix it runs the `normkit.conformance.cases.lean`
subset, which still shows every kind, dtype, option and kind of rows."""

TARGETS: tuple[Target, ...] = (
    _torch("torch", "normkit.torch modules (eager), kernel='auto'"),
    _torch("torch[composite]", "normkit.torch modules, torch ops", kernel="composite"),
    _torch(
        "torch[cpu-kernel]", "normkit.torch modules, numba CPU kernel", ("numba",), kernel="cpu"
    ),
    _torch(
        "torch[triton]", "normkit.torch modules, Triton kernels (interpreted off a GPU)",
        ("triton",), cost=20.0, kernel="triton",
    ),
    _keras("tensorflow", cost=2.0),
    _keras("tensorflow", cost=80.0, jit=True),
    _keras("jax", cost=90.0, jit=True),
    _keras("torch", cost=1.5),
    # The first JAX target fills the compilation cache the other two read.
    _jax("linen", cost=30.0),
    _jax("nnx", cost=18.0),
    _jax("functional", cost=18.0),
)
"""Every target, with its ``cost`` from a ``--full`` run on the 2-core machine (seconds per
case: torch 0.007, the Triton interpreter 0.14, Keras under XLA 0.57-0.63, JAX 0.12-0.33)."""


def _selects(name: str, target: Target) -> bool:
    """``name`` is the target's name, or a prefix of it ending where a ``[`` or ``.`` follows."""
    return target.name == name or target.name.startswith((name + "[", name + "."))


def select(names: Sequence[str] | None, registry: Sequence[Target] = TARGETS) -> list[Target]:
    """The targets ``names`` select (all when None); ValueError naming any that selects none,
    and for an empty ``names``, which selects nothing."""
    if names is None:
        return list(registry)
    if not names:
        raise ValueError("no backend named: an empty list of backends selects no target")
    unknown = [n for n in names if not any(_selects(n, t) for t in registry)]
    if unknown:
        raise ValueError(
            f"unknown backends {unknown}; known: {[t.name for t in registry]} "
            "(or a prefix: torch, tf, jax)"
        )
    return [t for t in registry if any(_selects(n, t) for n in names)]
