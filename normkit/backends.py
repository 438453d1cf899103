"""The backends normkit supports: one registry over the seam that `normkit.bridges` defines.

- `BACKENDS`: per backend its subpackage, pip extra, packages and worker environment, found
  without importing any framework. Install hints (`install_hint`) derive from it, as do
  conformance's targets and peers and the benchmark's workers.
- `bridge` returns a backend's `Bridge` (what each framework gives the harness: numpy <->
  tensor, its devices, the forward pass, and the VJP by inputs and named parameters), importing
  the framework on first use only. The protocol and the device names (`device_name`: ``cpu``,
  ``cuda:N`` with ``gpu:N`` accepted, ``tpu:N``, ``mps``) live in `normkit.bridges` and are
  re-exported here; the import goes one way, from here to there.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from normkit import bridges
from normkit.bridges import Bridge, FrameworkFn, VjpFn, VjpResult, device_name

__all__ = [
    "BACKENDS", "Alternative", "Backend", "Bridge", "FrameworkFn", "VjpFn", "VjpResult",
    "bridge", "device_name", "get", "install_hint",
]


@dataclass(frozen=True)
class Alternative:
    """Other packages that also make a backend usable (Keras on JAX for normkit.tf): what they
    are, and the environment that selects them."""

    packages: tuple[str, ...]
    env: Mapping[str, str]
    note: str

    def missing(self) -> list[str]:
        """Its packages that are not installed."""
        return _missing(self.packages)


@dataclass(frozen=True)
class Backend:
    """A normkit backend: its subpackage, pip extra, packages, bridge and worker environment,
    and the alternatives to its packages."""

    name: str
    module: str
    extra: str
    packages: tuple[str, ...]
    bridge: str
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    alternatives: tuple[Alternative, ...] = ()

    @property
    def install(self) -> str:
        """The command that installs this backend."""
        return install_hint([self.extra])

    def missing(self) -> list[str]:
        """The needed packages that are not installed."""
        return _missing(self.packages)

    def alternative(self) -> Alternative | None:
        """The first alternative whose packages are all installed, or None."""
        for alternative in self.alternatives:
            if not alternative.missing():
                return alternative
        return None

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
        """The devices the framework sees, asked in a subprocess; RuntimeError on failure."""
        probe = (
            "import json, os\n"
            "os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')\n"
            "from normkit import bridges\n"
            f"print(json.dumps(bridges.{self.bridge}().devices()))"
        )
        try:
            done = subprocess.run(
                [sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{self.name}: listing devices took over {timeout_s:.0f} s") from exc
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{self.name}: listing devices failed: {last}")
        return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _missing(packages: Iterable[str]) -> list[str]:
    """The ``packages`` that are not installed (found without importing them)."""
    return [p for p in packages if importlib.util.find_spec(p) is None]


BACKENDS: tuple[Backend, ...] = (
    # normkit's CPU kernel compiled in the worker's first call that needs it, never the
    # composite path measured or checked in its place on a machine that has not compiled it
    Backend("torch", "normkit.torch", "torch", ("torch",), "TorchBridge",
            {"NORMKIT_CPU_COMPILE": "wait"}),
    Backend(
        "tf", "normkit.tf", "tf", ("tensorflow", "keras"), "TensorFlowBridge",
        {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"},
        (
            Alternative(("keras", "jax"), {"KERAS_BACKEND": "jax"}, "Keras on JAX"),
            Alternative(("keras", "torch"), {"KERAS_BACKEND": "torch"}, "Keras on PyTorch"),
        ),
    ),
    Backend("jax", "normkit.jax", "jax", ("jax", "flax"), "JaxBridge"),
)


def get(name: str) -> Backend:
    """The backend called ``name``; ValueError naming the known ones otherwise."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise ValueError(f"unknown backend {name!r}; known: {[b.name for b in BACKENDS]}")


EXTRAS: dict[str, tuple[str, ...]] = {
    "torch": ("torch", "numba"),
    "tf": ("tensorflow", "keras"),
    "jax": ("jax", "flax"),
    "keras": ("keras", "jax"),
    "triton": ("torch", "triton"),
    "port": ("safetensors",),
    "bench": ("matplotlib",),
}
"""The packages each of normkit's pip extras installs (pyproject.toml's optional dependencies;
tests/test_install_hints.py holds them equal)."""


def install_hint(extras: Iterable[str], packages: Iterable[str] = ()) -> str:
    """``pip install 'normkit[extra,...]' package ...``: the command that installs ``extras``
    and ``packages``. A package an extra installs is not named again, and packages that make up
    a whole extra are installed by it (``keras`` with ``jax``: the ``keras`` extra)."""
    chosen = list(dict.fromkeys(extras))
    wanted = list(dict.fromkeys(packages))
    needed = {p for e in chosen for p in EXTRAS.get(e, ())} | set(wanted)
    for extra, installs in EXTRAS.items():
        if extra not in chosen and set(installs) <= needed and set(installs) & set(wanted):
            chosen.append(extra)
    covered = {p for e in chosen for p in EXTRAS.get(e, ())}
    rest = [p for p in wanted if p not in covered]
    head = f"pip install 'normkit[{','.join(chosen)}]'" if chosen else "pip install"
    return " ".join([head, *rest])


@functools.cache
def bridge(name: str) -> Bridge:
    """The bridge of backend ``name``; ImportError naming the extra if it is not installed."""
    backend = get(name)
    missing = backend.missing()
    if missing:
        raise ImportError(f"{', '.join(missing)} not installed: {backend.install}")
    found: Bridge = getattr(bridges, backend.bridge)()
    return found
