"""Hugging Face and mlx-lm model directories: ``config.json`` and safetensors, sharded or not.

The shards are listed by ``model.safetensors.index.json`` when there is one, else every
``*.safetensors`` file of the directory. mlx-lm writes ``{"format": "mlx"}`` into each file's
metadata (`mlx_lm.utils.save_model`); that is how its directories are told from Hugging Face's.
Pickle weights (``pytorch_model.bin``, ``*.pt``) are never read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from normkit.doctor.checkpoint import Checkpoint

__all__ = ["CONFIG", "INDEX", "read_directory"]

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def read_directory(path: Path) -> Checkpoint:
    """The model directory ``path``; ValueError without ``config.json`` or safetensors."""
    config_path = path / CONFIG
    if not config_path.is_file():
        raise ValueError(
            f"{path}: has no {CONFIG}; the doctor reads Hugging Face and mlx-lm model "
            "directories (config.json and safetensors), GGUF files and normkit norms files"
        )
    config = _json(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: is not a JSON object")
    files = _weight_files(path)
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as err:
        raise ImportError(
            f"{path}: reading safetensors needs: pip install 'normkit[doctor]'"
        ) from err
    where: dict[str, Path] = {}
    mlx = False
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                mlx = mlx or (f.metadata() or {}).get("format") == "mlx"
                where.update(dict.fromkeys(f.keys(), file))  # noqa: SIM118
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{file}: is not a readable safetensors file: {err}") from None

    def load(name: str) -> np.ndarray:
        with safe_open(str(where[name]), framework="numpy") as f:
            return np.asarray(f.get_tensor(name))

    model_type = config.get("model_type")
    return Checkpoint(
        path=path,
        format="mlx-lm" if mlx else "huggingface",
        architecture=model_type if isinstance(model_type, str) else None,
        config=config,
        names=tuple(where),
        load=load,
        files=where,
    )


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of ``path`` (its index's, if any); ValueError if there are none."""
    index = path / INDEX
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: has no 'weight_map' object")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index}: lists shards that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for pattern in _PICKLES for p in path.glob(pattern))
    if pickles:
        raise ValueError(
            f"{path}: holds only pickle weights ({', '.join(pickles[:3])}); normkit never "
            "unpickles (nothing was loaded): save the model with safetensors first "
            "(model.save_pretrained(..., safe_serialization=True))"
        )
    raise ValueError(f"{path}: has {CONFIG} but no safetensors weights")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: is not valid JSON: {err}") from None
