"""The conventions of a Hugging Face model's norms, found by probing transformers' own classes.

The model is built from its config on torch's ``meta`` device (no memory for its weights);
each norm module is copied onto the CPU and handed to `normkit.port.huggingface.swap_norms`,
which probes it with `normkit.identify` (kind, eps, offset, bias, cast order) and takes its eps
from the module or the config. Nothing is read from the checkpoint's weights here.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

from normkit.port.huggingface import swap_norms
from normkit.spec import NormSpec

__all__ = ["ProbedNorm", "probe_directory"]


@dataclass(frozen=True)
class ProbedNorm:
    """One norm module of the model: its class, and the spec `swap_norms` found for it with
    where its eps came from, or why it could not (``spec`` None)."""

    module: str
    spec: NormSpec | None
    eps_from: str
    reason: str = ""


def probe_directory(path: str | os.PathLike[str]) -> dict[str, ProbedNorm]:
    """``{module path: ProbedNorm}`` for every norm module of the model whose ``config.json`` is
    in ``path`` (a Hugging Face or mlx-lm directory: both keep transformers' config)."""
    config = transformers.AutoConfig.from_pretrained(Path(path), local_files_only=True)
    with torch.device("meta"):
        model = _build(config)
    norms = {
        name: module for name, module in model.named_modules()
        if next(module.children(), None) is None and _named_norm(module)
    }
    holder = nn.Module()
    keys = {}
    for i, (name, module) in enumerate(norms.items()):
        keys[f"norm{i}"] = name
        holder.add_module(f"norm{i}", _materialized(module))
    _, report = swap_norms(holder, config=config)
    found: dict[str, ProbedNorm] = {}
    for swap in report.swapped:
        found[keys[swap.path]] = ProbedNorm(swap.original, swap.spec, swap.eps_from)
    for left in report.left_alone:
        found[keys[left.path]] = ProbedNorm(left.original, None, "", left.reason)
    return found


def _build(config: transformers.PretrainedConfig) -> nn.Module:
    """The model of the class the config names (``architectures``), else its causal LM or base
    model."""
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls(config)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            model: nn.Module = auto.from_config(config)
        except ValueError:
            continue
        return model
    raise ValueError(f"transformers has no model class for model_type {config.model_type!r}")


def _named_norm(module: nn.Module) -> bool:
    """A candidate as `swap_norms` sees one (it filters again): a norm by class or name."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def _materialized(module: nn.Module) -> nn.Module:
    """A CPU copy of a ``meta`` module: weights 1, biases and buffers 0 (the probe sets its own
    parameters; the values only need to be finite)."""
    copied = copy.deepcopy(module).to_empty(device="cpu")
    with torch.no_grad():
        for name, tensor in [*copied.named_parameters(), *copied.named_buffers()]:
            tensor.fill_(1.0 if name.endswith("weight") else 0.0)
    return copied
