"""normkit for PyTorch: RMSNorm, PartialRMSNorm, LayerNorm and DyT modules that follow `NormSpec`.

``normkit.torch.functional`` has the same norms as functions;
``normkit.port.huggingface.swap_norms`` replaces the norm modules of a model (torch's and
Hugging Face's) with these. See docs/torch.md
and docs/porting.md.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:
    raise ImportError("normkit.torch needs PyTorch: pip install 'normkit[torch]'") from exc

import sys as _sys
import types as _types

from normkit.torch import functional
from normkit.torch.modules import (
    DyT,
    GatedRMSNorm,
    LayerNorm,
    PartialRMSNorm,
    RMSNorm,
    from_spec,
)
from normkit.torch.warmup import warmup

__all__ = [
    "RMSNorm", "GatedRMSNorm", "PartialRMSNorm", "LayerNorm", "DyT", "from_spec", "functional",
    "warmup",
]


def __getattr__(name: str) -> object:
    # The adapter does not import the porting tools built on it; it names where they are.
    if name == "swap_norms":
        message = (
            "normkit.torch.swap_norms is normkit.port.huggingface.swap_norms: "
            "from normkit.port.huggingface import swap_norms"
        )
        if _importing_from(_sys._getframe(1)):
            raise ImportError(message, name=__name__)
        raise AttributeError(message)
    raise AttributeError(f"module 'normkit.torch' has no attribute {name!r}")


def _importing_from(frame: _types.FrameType) -> bool:
    """Whether ``frame`` is running ``from normkit.torch import name``: Python replaces an
    AttributeError raised there by a generic ImportError ("cannot import name"), so the message
    naming the right module must come as an ImportError; ``hasattr`` and ``getattr`` still see
    an AttributeError."""
    import dis

    return frame.f_code.co_code[frame.f_lasti] == dis.opmap["IMPORT_FROM"]
