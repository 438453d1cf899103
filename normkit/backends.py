"""The backends normkit supports: one registry, one device naming scheme, one interop seam.

- `BACKENDS`: per backend its subpackage, pip extra, packages and worker environment, found
  without importing any framework. Install hints (`install_hint`) derive from it, as do
  conformance's targets and peers and the benchmark's workers.
- Device names are the same for every backend: ``cpu``, ``cuda:N`` (the N-th GPU; ``gpu:N`` is
  an accepted alias), ``tpu:N`` and ``mps``. `device_name` turns any accepted spelling into it.
- `Bridge`: what each framework gives the harness, numpy <-> tensor (bfloat16 included), its
  devices, and the forward pass and VJP of a framework function. `bridge` returns the
  framework's class from `normkit.bridges`, importing the framework on first use only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = [
    "BACKENDS", "Alternative", "Backend", "Bridge", "Outputs", "FrameworkFn", "bridge",
    "device_name", "get", "install_hint",
]

Outputs = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]
"""``(y, dx, dscale, dbias)`` as numpy arrays; None for a parameter that is absent."""
FrameworkFn = Callable[[Any, Any, Any], Any]
"""``fn(x, scale, bias) -> y`` on a framework's tensors (``scale``/``bias`` None when absent)."""

DEVICE_KINDS = ("cpu", "cuda", "tpu", "mps")
_DEVICE = re.compile(r"(cpu|cuda|gpu|tpu|mps)(?::(\d+))?")


def device_name(name: str) -> str:
    """The normkit name of a device: ``cpu``, ``cuda:N``, ``tpu:N`` or ``mps``.

    ``gpu:N`` is read as ``cuda:N``, a bare ``cuda``/``gpu``/``tpu`` as index 0, ``cpu:0`` as
    ``cpu``; anything else raises ValueError.
    """
    found = _DEVICE.fullmatch(name.strip().lower())
    if found is None:
        raise ValueError(
            f"{name!r} is not a device name: expected cpu, cuda:N (alias gpu:N), tpu:N or mps"
        )
    kind, index = found.groups()
    if kind in ("cpu", "mps"):
        if index not in (None, "0"):
            raise ValueError(f"{name!r} is not a device name: {kind} has no index")
        return kind
    return f"{'cuda' if kind == 'gpu' else kind}:{int(index or 0)}"


def device_index(name: str) -> tuple[str, int]:
    """``(kind, index)`` of a device name, e.g. ``("cuda", 1)`` for ``gpu:1``."""
    kind, _, index = device_name(name).partition(":")
    return kind, int(index or 0)


class Bridge(Protocol):
    """What a framework gives the harness; one small class per framework in `normkit.bridges`."""

    name: str

    def devices(self) -> list[str]:
        """The devices the framework sees, in normkit's names, ``cpu`` first."""
        ...

    def to_tensor(self, a: np.ndarray, device: str = "cpu") -> Any:
        """A numpy array (ml_dtypes' bfloat16 included) as a tensor of its dtype on ``device``."""
        ...

    def to_numpy(self, t: Any) -> np.ndarray:
        """A tensor as a numpy array of its dtype (bfloat16 as ml_dtypes'), on the host."""
        ...

    def forward(
        self, fn: FrameworkFn, x: np.ndarray, scale: np.ndarray | None,
        bias: np.ndarray | None, device: str,
    ) -> np.ndarray:
        """``fn(x, scale, bias)`` on ``device``, as numpy."""
        ...

    def vjp(
        self, fn: FrameworkFn, x: np.ndarray, dy: np.ndarray, scale: np.ndarray | None,
        bias: np.ndarray | None, device: str,
    ) -> Outputs:
        """``y = fn(x, scale, bias)`` and the gradients of ``<y, dy>`` by x, scale and bias."""
        ...


@dataclass(frozen=True)
class Alternative:
    """Other packages that also make a backend usable (Keras on JAX for normkit.tf): what they
    are, and the environment that selects them."""

    packages: tuple[str, ...]
    env: Mapping[str, str]
    note: str


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
        return [p for p in self.packages if importlib.util.find_spec(p) is None]

    def alternative(self) -> Alternative | None:
        """The first alternative whose packages are all installed, or None."""
        for alternative in self.alternatives:
            if all(importlib.util.find_spec(p) is not None for p in alternative.packages):
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


BACKENDS: tuple[Backend, ...] = (
    Backend("torch", "normkit.torch", "torch", ("torch",), "TorchBridge"),
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


def install_hint(extras: Iterable[str], packages: Iterable[str] = ()) -> str:
    """``pip install 'normkit[extra,...]' package ...``: the command that installs them."""
    names = ",".join(dict.fromkeys(extras))
    return " ".join([f"pip install 'normkit[{names}]'", *packages])


@functools.cache
def bridge(name: str) -> Bridge:
    """The bridge of backend ``name``; ImportError naming the extra if it is not installed."""
    backend = get(name)
    missing = backend.missing()
    if missing:
        raise ImportError(f"{', '.join(missing)} not installed: {backend.install}")
    bridges = importlib.import_module("normkit.bridges")
    found: Bridge = getattr(bridges, backend.bridge)()
    return found
