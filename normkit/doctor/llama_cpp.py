"""llama.cpp's conventions for the norms in a GGUF file, taken from its source (not probed:
llama.cpp is C++ and not a Python dependency). Each rule names where it comes from, in
github.com/ggml-org/llama.cpp.

- The runtime: ``llm_graph_context::build_norm`` (src/llama-graph.cpp) computes
  ``ggml_rms_norm`` (or ``ggml_norm``) and multiplies by the stored weight, then adds the stored
  bias: no offset, whatever the architecture.
- eps: the hyperparameters ``f_norm_rms_eps`` and ``f_norm_eps`` (src/llama-model.cpp), read
  from the metadata keys ``{arch}.attention.layer_norm_rms_epsilon`` and
  ``{arch}.attention.layer_norm_epsilon`` (gguf's ``Keys.Attention``).
- The converter (convert_hf_to_gguf.py, whose model classes live in conversion/*.py) adds the
  1 of a ``1 + w`` norm into the stored weights for the architectures in `BAKED_OFFSETS`, so
  that the runtime's plain multiplication computes the model.
- The converter stores every norm weight in F32 (``ModelBase.prepare_tensors``,
  conversion/base.py: ``n_dims <= 1 or new_name.endswith("_norm.weight")`` gives F32), after
  upcasting bfloat16 tensors to float32 (the ``+ 1`` is then exact).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BAKED_OFFSETS",
    "NORM_DTYPE",
    "BakedOffset",
    "baked_offset",
    "eps_key",
    "gguf_names",
]

RUNTIME = "llama.cpp"
RUNTIME_SOURCE = "llama.cpp src/llama-graph.cpp llm_graph_context::build_norm (weight as stored)"
NORM_DTYPE = "float32"
NORM_DTYPE_SOURCE = "llama.cpp conversion/base.py ModelBase.prepare_tensors (norms in F32)"


@dataclass(frozen=True)
class BakedOffset:
    """The converter adds ``offset`` to every stored tensor whose GGUF name ends with
    ``suffix`` but none of ``excluded`` (``excluded``: GGUF names of the Hugging Face tensors the
    rule leaves out, mapped by gguf's ``TensorNameMap``), for these ``architectures``
    (``general.architecture``)."""

    architectures: tuple[str, ...]
    offset: float
    source: str
    suffix: str = "norm.weight"
    excluded: tuple[str, ...] = ()

    def applies(self, name: str) -> bool:
        """Whether the converter shifted the GGUF tensor ``name``."""
        return name.endswith(self.suffix) and not name.endswith(self.excluded)


BAKED_OFFSETS: tuple[BakedOffset, ...] = (
    BakedOffset(
        ("gemma",), 1.0,
        "llama.cpp convert_hf_to_gguf.py (conversion/gemma.py) GemmaModel.modify_tensors: "
        "name.endswith('norm.weight') -> data_torch + 1",
    ),
    BakedOffset(
        ("gemma2",), 1.0,
        "llama.cpp convert_hf_to_gguf.py (conversion/gemma.py) Gemma2Model.modify_tensors: "
        "name.endswith('norm.weight') -> data_torch + 1",
    ),
    BakedOffset(
        ("gemma3", "gemma-embedding"), 1.0,
        "llama.cpp convert_hf_to_gguf.py (conversion/gemma.py) Gemma3Model.modify_tensors: "
        "name.endswith('norm.weight') -> data_torch + norm_shift (1.0; EmbeddingGemma inherits "
        "it, Gemma3NModel sets 0.0)",
    ),
    BakedOffset(
        ("qwen3next", "qwen35", "qwen35moe"), 1.0,
        "llama.cpp convert_hf_to_gguf.py (conversion/qwen.py) Qwen3NextModel.modify_tensors: "
        "name.endswith('norm.weight') and not name.endswith('linear_attn.norm.weight') -> "
        "data_torch + 1 (Qwen3.5 through _LinearAttentionVReorderBase, a Qwen3NextModel)",
        excluded=("ssm_norm.weight",),
    ),
    BakedOffset(
        ("nemotron",), 1.0,
        "llama.cpp convert_hf_to_gguf.py (conversion/nemotron.py) NemotronModel.modify_tensors: "
        "name.endswith('norm.weight') -> data_torch + 1 (layernorm1p)",
    ),
)
"""The architectures whose ``1 + w`` norms the converter stores as ``1 + w`` (Gemma 4 and
Gemma 3n have plain norms and are not listed)."""


def baked_offset(architecture: str | None, name: str) -> BakedOffset | None:
    """The rule that shifted GGUF tensor ``name`` of ``architecture``, or None."""
    for rule in BAKED_OFFSETS:
        if architecture in rule.architectures and rule.applies(name):
            return rule
    return None


def eps_key(metadata: Mapping[str, Any]) -> tuple[str, float] | None:
    """``(key, eps)`` of the norms of a GGUF's ``metadata``: the RMS norms' key if present, else
    LayerNorm's; None when it has neither."""
    arch = metadata.get("general.architecture")
    for key in (f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.attention.layer_norm_epsilon"):
        value = metadata.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return key, float(value)
    return None


def gguf_names(metadata: Mapping[str, Any], names: Iterable[str]) -> dict[str, str]:
    """``{name: GGUF name}`` for the Hugging Face tensor ``names`` that gguf's ``TensorNameMap``
    maps for the GGUF's architecture and block count (as the converter names them)."""
    import gguf

    arch = metadata.get("general.architecture")
    kinds = {name: kind for kind, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in kinds:
        return {}
    blocks = metadata.get(f"{arch}.block_count")
    table = gguf.get_tensor_name_map(kinds[arch], int(blocks) if isinstance(blocks, int) else 0)
    mapped = {}
    for name in names:
        for prefix in ("", "model.", "language_model."):  # as the converters strip them
            new = table.get_name(name.removeprefix(prefix), try_suffixes=(".weight", ".bias"))
            if new is not None:
                mapped[name] = new
                break
    return mapped
