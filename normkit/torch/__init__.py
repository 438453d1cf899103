"""normkit for PyTorch: RMSNorm, PartialRMSNorm and LayerNorm modules that follow `NormSpec`.

``normkit.torch.functional`` has the same norms as functions. See docs/torch.md.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:
    raise ImportError("normkit.torch needs PyTorch: pip install 'normkit[torch]'") from exc

from normkit.torch import functional
from normkit.torch.modules import LayerNorm, PartialRMSNorm, RMSNorm, from_spec

__all__ = ["RMSNorm", "PartialRMSNorm", "LayerNorm", "from_spec", "functional"]
