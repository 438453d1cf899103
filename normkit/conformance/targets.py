"""The registry of implementations conformance runs: normkit's adapters, and the frameworks' peers.

Each target names a hook module with ``devices()`` and ``evaluate(spec, x, dy, scale, bias, *,
device, **variant)``, the normkit backend it needs installed, and the environment its worker
process needs (``KERAS_BACKEND`` for the Keras targets: Keras picks its backend at import).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from normkit.spec import NormSpec


@dataclass(frozen=True)
class Target:
    """One implementation to check.

    Attributes:
      name: shown in reports, e.g. ``"jax.nnx"`` or ``"tf[jax]"``.
      requires: the packages that must be installed.
      install: the command that installs them.
      hook: the module with ``devices`` and ``evaluate``.
      variant: keyword arguments for ``evaluate``.
      env: environment variables for the worker process.
      claims: for a peer, the NormSpec the built-in layer appears to implement; its cases use it.
      note: what the target is, for the report.
    """

    name: str
    requires: tuple[str, ...]
    install: str
    hook: str
    variant: dict[str, object] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    claims: NormSpec | None = None
    note: str = ""

    def missing(self) -> str | None:
        """Why this target cannot run here (its framework is not installed), or None."""
        missing = [p for p in self.requires if importlib.util.find_spec(p) is None]
        if missing:
            return f"{', '.join(missing)} not installed ({self.install})"
        return None


def _keras(backend: str, **variant: object) -> Target:
    suffix = ",jit" if variant.get("jit") else ""
    return Target(
        f"tf[{backend}{suffix}]",
        ("keras", backend),
        f"pip install 'normkit[{'tf' if backend == 'tensorflow' else 'tf,' + backend}]'",
        "normkit.tf.conformance",
        dict(variant),
        {"KERAS_BACKEND": backend},
        note=f"normkit.tf on the {backend} Keras backend" + (" under jit" if suffix else ""),
    )


TARGETS: tuple[Target, ...] = (
    Target("torch", ("torch",), "pip install 'normkit[torch]'", "normkit.torch.conformance", note="normkit.torch modules (eager)"),
    _keras("tensorflow"),
    _keras("tensorflow", jit=True),
    _keras("jax", jit=True),
    _keras("torch"),
    *(
        Target(f"jax.{api}", ("jax", "flax"), "pip install 'normkit[jax]'", "normkit.jax.conformance", {"api": api}, note=f"normkit.jax {api}, jitted")
        for api in ("linen", "nnx", "functional")
    ),
)


def select(names: list[str] | None, registry: tuple[Target, ...] = TARGETS) -> list[Target]:
    """The targets whose name equals, or starts with, one of ``names`` (all when None)."""
    if not names:
        return list(registry)
    chosen = [t for t in registry if any(t.name == n or t.name.startswith(n + "[") or t.name.startswith(n + ".") for n in names)]
    unknown = [n for n in names if not any(t.name == n or t.name.startswith(n) for t in registry)]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; known: {[t.name for t in registry]}")
    return chosen
