"""normkit: one definition of RMSNorm, partial RMSNorm and LayerNorm, and layers that follow it.

``NormSpec`` describes a norm; ``normkit.reference`` computes it in numpy float64;
``normkit.tolerances`` says how close an implementation must come. The framework adapters live
in ``normkit.torch``, ``normkit.tf`` and ``normkit.jax``, each imported on its own.
"""

from importlib import metadata as _metadata
from pathlib import Path as _Path

from normkit import dtypes, reference, tolerances
from normkit.spec import NormSpec


def _version() -> str:
    """The installed distribution's version; in a source tree that is not installed, the one
    written in its ``pyproject.toml`` (the only place the version is written); else unknown."""
    try:
        return _metadata.version("normkit")
    except _metadata.PackageNotFoundError:
        import tomllib

        pyproject = _Path(__file__).resolve().parent.parent / "pyproject.toml"
        if not pyproject.is_file():
            return "0+unknown"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


__version__ = _version()

__all__ = ["NormSpec", "dtypes", "reference", "tolerances", "__version__"]
