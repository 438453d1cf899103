"""Which tensor of the original checkpoint each converted tensor came from.

Hugging Face, mlx-lm and normkit files name a norm by its module path (normkit files as read by
`normkit.doctor.read_norms`, with torch's ``weight``/``bias``), so the names match as they are.
A GGUF file names it as llama.cpp's converter does; gguf's ``TensorNameMap`` maps the other
side's names to those.
"""

from __future__ import annotations

from collections.abc import Iterable

from normkit.doctor import llama_cpp
from normkit.doctor.checkpoint import Checkpoint

__all__ = ["counterparts"]


def counterparts(converted: Checkpoint, original: Checkpoint, names: Iterable[str]) -> dict[
        str, str]:
    """``{converted name: original name}`` for those of ``names`` the original holds."""
    held = set(original.names)
    names = list(names)
    if (converted.format == "gguf") == (original.format == "gguf"):
        return {name: name for name in names if name in held}
    if converted.format == "gguf":
        to_gguf = llama_cpp.gguf_names(converted.config, original.names)
        back = {new: old for old, new in to_gguf.items()}
        return {name: back[name] for name in names if name in back}
    to_gguf = llama_cpp.gguf_names(original.config, names)
    return {name: to_gguf[name] for name in names if to_gguf.get(name) in held}
