"""Porting norms between frameworks: parameters, files and whole models (see docs/porting.md).

- `convert`: a norm's parameters between the torch, keras, flax and numpy conventions, and
  between ``scale_offset`` conventions.
- `save` / `load`, `save_norms` / `load_norms`: parameters with their `NormSpec` in a
  safetensors (or ``.npz``) file; never pickle.
- `load_modules`: a norms file's layers as torch, Keras, Flax NNX or linen modules, keyed by
  their paths (no model needed).
- `export_norms` / `import_norms`: every normkit norm of a torch, Keras or Flax NNX model, keyed
  by its path in the model. ``normkit.port.huggingface.swap_norms`` turns a torch model's own
  norms (Hugging Face's included) into normkit's; ``normkit.port.flax`` also handles linen.

This package imports numpy only; each framework's functions import it in their own module.
"""

from normkit.port.convert import CONVENTIONS, NAMES, Convention, convert
from normkit.port.files import FORMAT_VERSION, load, load_norms, save, save_norms
from normkit.port.models import export_norms, import_norms
from normkit.port.modules import load_modules

__all__ = [
    "CONVENTIONS",
    "NAMES",
    "Convention",
    "FORMAT_VERSION",
    "convert",
    "save",
    "load",
    "save_norms",
    "load_norms",
    "export_norms",
    "import_norms",
    "load_modules",
]
