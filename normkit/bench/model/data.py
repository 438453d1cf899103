"""The task the model learns: sorting, generated and seeded in numpy, the same in every framework.

A sequence is ``items`` symbols drawn uniformly from ``symbols``, the separator (token
``symbols``), then the same symbols sorted. The model reads all but the last token and predicts
each next one; the loss counts the sorted half only (`Batches.weights`), which is fully
determined by the first half: a model that sorts reaches a loss of 0, one that has learned only
which symbols are frequent stays near ``log(symbols)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from normkit.bench.model.config import ModelConfig


@dataclass(frozen=True)
class Batches:
    """Every training step's batch: ``inputs`` and ``targets`` ``(steps, batch, seq_len)``
    int32, and the loss ``weights`` ``(seq_len,)`` float32, 1 where the target is a sorted
    symbol, else 0 (the loss is ``sum(ce * weights) / sum(weights)`` over the batch)."""

    inputs: np.ndarray
    targets: np.ndarray
    weights: np.ndarray


def batches(config: ModelConfig, steps: int | None = None) -> Batches:
    """The batches of ``steps`` (default ``config.steps``) training steps, from ``config.seed``."""
    count = config.steps if steps is None else steps
    rng = np.random.default_rng(config.seed)
    symbols = rng.integers(0, config.symbols, size=(count, config.batch, config.items))
    separator = np.full((count, config.batch, 1), config.symbols)
    sequences = np.concatenate([symbols, separator, np.sort(symbols, axis=-1)], axis=-1)
    weights = (np.arange(config.seq_len) >= config.items).astype(np.float32)
    return Batches(
        sequences[..., :-1].astype(np.int32), sequences[..., 1:].astype(np.int32), weights
    )
