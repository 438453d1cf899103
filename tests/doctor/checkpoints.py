"""Tiny checkpoints for the doctor's tests: Hugging Face models of each family with their norms
moved off their initial values, converted by the real converters (mlx-lm's ``convert``; a GGUF
written with the ``gguf`` package following llama.cpp's converter), and the bugs planted."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
              linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8)
# family: (config class, model class, extra config, GGUF architecture)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "llama"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, "gemma"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}, "gemma2"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, "gemma3"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, "qwen3"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(LINEAR, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16, full_attention_interval=2),
                   "qwen3next"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", LINEAR, "qwen35"),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}, "command-r"),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}, "olmo"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "olmo2"),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                decoder_start_token_id=0), "t5"),
}

# llama.cpp's converter (github.com/ggml-org/llama.cpp, convert_hf_to_gguf.py and its
# conversion/*.py): GemmaModel, Gemma2Model and Gemma3Model.modify_tensors add 1 to every
# "*norm.weight"; Qwen3NextModel.modify_tensors (Qwen3.5 inherits it) to every one but
# "linear_attn.norm.weight"; the other families' are written as they are.
def _every_norm(name: str) -> bool:
    return name.endswith("norm.weight")


BAKED: dict[str, Callable[[str], bool]] = {
    "gemma": _every_norm, "gemma2": _every_norm, "gemma3": _every_norm,
    "qwen3_next": lambda n: _every_norm(n) and not n.endswith("linear_attn.norm.weight"),
    "qwen3_5": lambda n: _every_norm(n) and not n.endswith("linear_attn.norm.weight"),
}


def hf_model(family: str, folder: Path, *, dtype: str = "float32", seed: int = 0) -> Path:
    """A tiny Hugging Face model of ``family`` saved in ``folder`` (with a word-level
    tokenizer, so mlx-lm can load it): each norm's weight its initial value plus N(0, 0.1) (so
    effective scales near 1), biases N(0, 0.1)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config_class, model_class, extra, _ = FAMILIES[family]
    base = {} if family == "t5" else BASE
    config = getattr(transformers, config_class)(**{**base, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    # mlx-lm reads rope_theta and partial_rotary_factor at the top level, where transformers 4
    # wrote them (transformers 5 nests them in rope_parameters)
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved.get("rope_parameters", {}), **saved}))
    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)
    return folder


def tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a directory's safetensors files."""
    from safetensors import safe_open

    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    return found


def to_gguf(hf: Path, out: Path, family: str, *, bake: float | None = None, eps: float | None = None,
            norm_type: str = "F32") -> Path:
    """``hf`` written as llama.cpp's converter writes it: names by gguf's ``TensorNameMap``,
    bfloat16 upcast to float32, the family's norms shifted by 1 (``bake`` overrides the shift of
    those norms: 0 plants a missing offset, 2 a doubled one), norms in F32 (``norm_type``
    "BF16" plants a narrowed dtype), the config's eps in the metadata (``eps`` plants another)."""
    import gguf

    config = json.loads((hf / "config.json").read_text())
    arch_name = FAMILIES[family][3]
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    blocks = config.get("num_hidden_layers", config.get("num_layers"))
    names = gguf.get_tensor_name_map(arch, blocks)
    writer = gguf.GGUFWriter(out, arch_name)
    writer.add_block_count(blocks)
    rms = config.get("rms_norm_eps", config.get("layer_norm_epsilon"))
    if family == "cohere":
        writer.add_layer_norm_eps(eps if eps is not None else config["layer_norm_eps"])
    else:
        writer.add_layer_norm_rms_eps(eps if eps is not None else rms)
    baked = BAKED.get(family, lambda name: False)
    for name, value in tensors(hf).items():
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            continue
        data = value.astype(np.float32) if value.dtype == ml_dtypes.bfloat16 else value
        if baked(name):
            data = data + np.float32(1.0 if bake is None else bake)
        if new.endswith("norm.weight") and norm_type == "BF16":
            writer.add_tensor(new, data.astype(ml_dtypes.bfloat16).view(np.uint16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(new, np.ascontiguousarray(data, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def to_mlx(hf: Path, out: Path, **options: object) -> Path:
    """``hf`` converted by mlx-lm's own ``convert``."""
    from mlx_lm.convert import convert

    convert(str(hf), str(out), **options)
    return out


def edit(folder: Path, out: Path, change: Callable[[str, np.ndarray], np.ndarray],
         config: dict | None = None) -> Path:
    """A copy of a model directory with each tensor through ``change(name, value)`` and the
    config updated with ``config``: how the tests plant a bug in a conversion."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    shutil.copytree(folder, out)
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as f:
            metadata = f.metadata()
            values = {k: change(k, f.get_tensor(k)) for k in f.keys()}
        save_file(values, str(file), metadata=metadata)
    if config:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out
