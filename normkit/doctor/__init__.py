"""The doctor: find the norm bugs in a converted checkpoint (``normkit doctor``).

`examine(path, against=None)` reads a checkpoint (a Hugging Face or mlx-lm directory, a GGUF
file, a normkit norms file) and returns a `Report`: for each norm tensor, the convention its
runtime expects (probed from transformers' and mlx-lm's classes with `normkit.identify`, or
llama.cpp's rules from its source), what the stored weights are, and the verdicts (fine, offset
baked in, offset doubled, offset missing, eps different, dtype narrowed). With the original
checkpoint (``against``) every tensor is compared with its counterpart, exactly; `fix` then
writes a corrected checkpoint. See docs/porting.md.

Importing this package imports numpy only; the formats' packages (torch and transformers, mlx-lm,
gguf, safetensors) are imported when a checkpoint needs them.
"""

from normkit.doctor.examine import examine
from normkit.doctor.report import (
    FINDINGS,
    Comparison,
    Confidence,
    Convention,
    Report,
    Stored,
    TensorReport,
    Verdict,
)

__all__ = [
    "FINDINGS",
    "Comparison",
    "Confidence",
    "Convention",
    "Report",
    "Stored",
    "TensorReport",
    "Verdict",
    "examine",
]
