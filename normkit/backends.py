"""Which framework backends are installed, their versions and devices, found without importing them.

Installation and versions come from package metadata; devices need the framework itself, so each
is asked in a subprocess of its own (a slow or broken framework cannot take normkit down with it),
through the backend's conformance hook, so the names are those ``--device`` filters take.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backend:
    """A normkit backend: its subpackage, the install extra, and the packages it needs."""

    name: str
    module: str
    extra: str
    packages: tuple[str, ...]
    device_probe: str = field(repr=False)

    def missing(self) -> list[str]:
        """The needed packages that are not installed."""
        return [p for p in self.packages if importlib.util.find_spec(p) is None]

    def versions(self) -> dict[str, str | None]:
        """Each needed package's installed version, or None."""
        found: dict[str, str | None] = {}
        for package in self.packages:
            try:
                found[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                found[package] = None
        return found

    def devices(self, timeout_s: float = 120.0) -> list[str]:
        """The devices the framework sees, asked in a subprocess; raises RuntimeError on failure."""
        try:
            done = subprocess.run(
                [sys.executable, "-c", self.device_probe],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{self.name}: listing devices took over {timeout_s:.0f} s") from exc
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{self.name}: listing devices failed: {last}")
        return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _probe(hook: str) -> str:
    """Code that prints, as JSON, the device names the backend's conformance hook uses."""
    return (
        "import os, json\n"
        "os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')\n"
        f"from {hook} import devices\n"
        "print(json.dumps(devices()))"
    )


BACKENDS: tuple[Backend, ...] = (
    Backend("torch", "normkit.torch", "torch", ("torch",), _probe("normkit.torch.conformance")),
    Backend("tf", "normkit.tf", "tf", ("tensorflow", "keras"), _probe("normkit.tf.conformance")),
    Backend("jax", "normkit.jax", "jax", ("jax", "flax"), _probe("normkit.jax.conformance")),
)


def get(name: str) -> Backend:
    """The backend called ``name``; ValueError naming the known ones otherwise."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise ValueError(f"unknown backend {name!r}; known: {[b.name for b in BACKENDS]}")
