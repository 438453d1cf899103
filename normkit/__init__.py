"""normkit: one definition of RMSNorm, partial RMSNorm and LayerNorm, and layers that follow it.

``NormSpec`` describes a norm; ``normkit.reference`` computes it in numpy float64;
``normkit.tolerances`` says how close an implementation must come. The framework adapters live
in ``normkit.torch``, ``normkit.tf`` and ``normkit.jax``, each imported on its own.
"""

from normkit import dtypes, reference, tolerances
from normkit.spec import NormSpec

__all__ = ["NormSpec", "__version__", "dtypes", "reference", "tolerances"]
__version__: str  # set on first use, see __getattr__


def _version() -> str:
    """The installed distribution's version; in a source tree that is not installed, the one
    written in its ``pyproject.toml`` (the only place the version is written); else unknown."""
    from importlib import metadata

    try:
        return metadata.version("normkit")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        if not pyproject.is_file():
            return "0+unknown"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


def __getattr__(name: str) -> str:
    # ``__version__`` is looked up on first use: importlib.metadata would double the import time.
    if name == "__version__":
        globals()["__version__"] = version = _version()
        return version
    raise AttributeError(f"module 'normkit' has no attribute {name!r}")
