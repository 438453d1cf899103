"""The model's initial weights, drawn once in numpy and written to files every framework loads.

- ``weights.npz``: the matrices by parameter path, in the layout ``(inputs, outputs)`` of Keras'
  and Flax's kernels (torch's ``nn.Linear`` holds the transpose): ``embed`` ``(vocab, d)``;
  ``blocks.<i>.attention.{query,key,value,out}`` ``(d, d)``;
  ``blocks.<i>.mlp.{gate,up}`` ``(d, d_ff)`` and ``blocks.<i>.mlp.down`` ``(d_ff, d)``;
  ``head`` ``(d, vocab)``. Each framework's model maps these paths onto its layers.
- ``norms-<norm>.npz``: the norms, a normkit norms file (`normkit.port.save_norms`) keyed by the
  norms' paths in the model (`ModelConfig.norm_paths`), with their `NormSpec`; normkit's layers
  load it with `normkit.port.import_norms`, the frameworks' own with `normkit.port.load_norms`.

The matrices are normal with standard deviation ``init_std`` (the output projections divided by
``sqrt(2 * layers)``, GPT-2's rule); the norms' parameters start where the layers start them
(scale 1, bias 0, DyT's alpha 0.5) plus normal jitter of ``norm_jitter`` (relative for alpha),
so that a norm parameter that did not move between frameworks would change the loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from normkit.bench.model.config import SPECS, ModelConfig
from normkit.port import load_norms, save_norms
from normkit.port.convert import param_names

WEIGHTS_FILE = "weights.npz"


def matrices(config: ModelConfig) -> dict[str, np.ndarray]:
    """Every parameter but the norms', by path, float32."""
    rng = np.random.default_rng([config.seed, 1])
    d, ff, std = config.d_model, config.d_ff, config.init_std
    shapes: dict[str, tuple[tuple[int, int], float]] = {"embed": ((config.vocab, d), std)}
    for i in range(config.layers):
        for name in ("query", "key", "value", "out"):
            scale = std / math.sqrt(2 * config.layers) if name == "out" else std
            shapes[f"blocks.{i}.attention.{name}"] = ((d, d), scale)
        shapes[f"blocks.{i}.mlp.gate"] = ((d, ff), std)
        shapes[f"blocks.{i}.mlp.up"] = ((d, ff), std)
        shapes[f"blocks.{i}.mlp.down"] = ((ff, d), std / math.sqrt(2 * config.layers))
    shapes["head"] = ((d, config.vocab), std)
    return {
        path: (rng.standard_normal(shape) * scale).astype(np.float32)
        for path, (shape, scale) in shapes.items()
    }


def norm_params(config: ModelConfig, norm: str) -> dict[str, tuple[dict[str, np.ndarray], object]]:
    """The norms of the model with norm ``norm`` (a key of `SPECS`): ``{path: (params in the
    numpy convention, spec)}``, as `normkit.port.save_norms` takes them."""
    spec = SPECS[norm]
    rng = np.random.default_rng([config.seed, 2])  # the same draws for every norm
    layers: dict[str, tuple[dict[str, np.ndarray], object]] = {}
    for path in config.norm_paths():
        jitter = rng.standard_normal((3, config.d_model)) * config.norm_jitter
        alpha = (spec.alpha_init or 0.0) * (1.0 + jitter[2, :1])
        start = {"scale": 1.0 + jitter[0], "bias": jitter[1], "alpha": alpha}
        params = {name: start[name].astype(np.float32) for name in param_names(spec, "numpy")}
        layers[path] = (params, spec)
    return layers


def write(config: ModelConfig, folder: Path, norms: list[str]) -> None:
    """Write ``weights.npz`` and a norms file for each of ``norms`` into ``folder``."""
    np.savez(folder / WEIGHTS_FILE, **matrices(config))  # type: ignore[arg-type]
    for norm in norms:
        save_norms(norms_file(folder, norm), norm_params(config, norm))  # type: ignore[arg-type]


def norms_file(folder: Path | str, norm: str) -> Path:
    return Path(folder) / f"norms-{norm}.npz"


def read_matrices(folder: Path | str) -> dict[str, np.ndarray]:
    """``weights.npz`` as written by `write` (never unpickled)."""
    with np.load(Path(folder) / WEIGHTS_FILE, allow_pickle=False) as found:
        return {name: found[name] for name in found.files}


def read_norms(folder: Path | str, norm: str, convention: str) -> dict[str, dict[str, np.ndarray]]:
    """The norms of ``norm`` named in ``convention`` (`normkit.port.load_norms`), by path:
    what the frameworks' own layers are assigned."""
    return {path: params for path, (params, _) in load_norms(norms_file(folder, norm),
                                                             to=convention).items()}


def rope(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The rotary embedding's ``cos`` and ``sin``, ``(seq_len, head_dim)`` float32, in the
    rotate-half layout (Llama's): frequency ``i`` at columns ``i`` and ``i + head_dim / 2``."""
    half = config.head_dim // 2
    inverse = config.rope_base ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.arange(config.seq_len, dtype=np.float64)[:, None] * inverse[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
