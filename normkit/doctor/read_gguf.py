"""GGUF files (llama.cpp's format), read with the ``gguf`` package (the ``doctor`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from normkit import dtypes
from normkit.doctor.checkpoint import Checkpoint

__all__ = ["read_gguf"]


def read_gguf(path: Path) -> Checkpoint:
    """The GGUF file ``path``: its metadata as ``config`` and its tensors by GGUF name
    (``blk.0.attn_norm.weight``); F32, F16 and BF16 tensors as they are, quantized ones
    dequantized to float32."""
    try:
        import gguf
    except ImportError as err:
        raise ImportError(f"{path}: reading GGUF needs: pip install 'normkit[doctor]'") from err
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as err:
        raise ValueError(f"{path}: is not a readable GGUF file: {err}") from None
    metadata: dict[str, Any] = {
        name: field.contents() for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }
    tensors = {t.name: t for t in reader.tensors}
    kinds = gguf.GGMLQuantizationType

    def load(name: str) -> np.ndarray:
        tensor = tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dims innermost first
        data = np.asarray(tensor.data)
        if tensor.tensor_type == kinds.BF16:
            return np.ascontiguousarray(data).view(np.uint16).view(dtypes.bfloat16).reshape(shape)
        if tensor.tensor_type in (kinds.F32, kinds.F16, kinds.F64):
            return data.reshape(shape).copy()
        return np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), np.float32).reshape(
            shape
        )

    architecture = metadata.get("general.architecture")
    return Checkpoint(
        path=path,
        format="gguf",
        architecture=architecture if isinstance(architecture, str) else None,
        config=metadata,
        names=tuple(tensors),
        load=load,
    )
