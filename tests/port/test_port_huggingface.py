"""normkit.port.huggingface.swap_norms: every norm recognised by probing, outputs unchanged.

Tiny, locally configured Hugging Face models (no downloads): each is built from a seeded random
init, its norms' parameters moved off their initial values, then swapped; greedy ``generate``
gives the same tokens and the logits stay within `LOGITS_REL`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.backends import bridge  # noqa: E402
from normkit.port.huggingface import LeftAlone, Swap, SwapReport, swap_norms  # noqa: E402
from normkit.torch import LayerNorm, RMSNorm  # noqa: E402

# A swapped norm is within normkit's float32 bound of the original (FORWARD_REL of max|y|); the
# logits pass through up to five norms and the layers between them, each of which can scale that
# relative error by a small factor: 10 times the per-norm bound, the same 1e-5 Hugging Face's own
# cross-framework equivalence tests use in float32.
LOGITS_REL = 10 * tolerances.FORWARD_REL
NEW_TOKENS = 8
VOCAB = 100
TOKENS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, **TOKENS)


@dataclass(frozen=True)
class Architecture:
    config: Callable[[], object]
    swapped: frozenset[str]
    left_alone: frozenset[str] = field(default_factory=frozenset)
    seq2seq: bool = False


def arch(config, swapped, left_alone=(), seq2seq=False):
    return Architecture(config, frozenset(swapped), frozenset(left_alone), seq2seq)


def cfg(name, **options):
    return lambda: getattr(transformers, name)(**options)


ARCHITECTURES = {
    "llama": arch(cfg("LlamaConfig", **DECODER), {"LlamaRMSNorm"}),
    "mistral": arch(cfg("MistralConfig", **DECODER), {"MistralRMSNorm"}),
    "mixtral": arch(cfg("MixtralConfig", **DECODER, num_local_experts=2, num_experts_per_tok=1),
                    {"MixtralRMSNorm"}),
    "qwen2": arch(cfg("Qwen2Config", **DECODER), {"Qwen2RMSNorm"}),
    "qwen3": arch(cfg("Qwen3Config", **DECODER, head_dim=8), {"Qwen3RMSNorm"}),
    "gemma": arch(cfg("GemmaConfig", **DECODER, head_dim=8), {"GemmaRMSNorm"}),
    "gemma2": arch(cfg("Gemma2Config", **DECODER, head_dim=8), {"Gemma2RMSNorm"}),
    "gemma3": arch(cfg("Gemma3TextConfig", **DECODER, head_dim=8), {"Gemma3RMSNorm"}),
    # the value norm has no weight, so its size (head_dim) is not the module's to tell
    "gemma3n": arch(cfg("Gemma3nTextConfig", **DECODER, head_dim=8, vocab_size_per_layer_input=VOCAB,
                        hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
                        num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0],
                        layer_types=["sliding_attention", "full_attention"]),
                    {"Gemma3nRMSNorm"}, {"Gemma3nRMSNorm"}),
    "phi3": arch(cfg("Phi3Config", **DECODER), {"Phi3RMSNorm"}),
    "phi": arch(cfg("PhiConfig", **DECODER), {"LayerNorm"}),
    "olmo": arch(cfg("OlmoConfig", **DECODER), {"OlmoLayerNorm"}),
    "olmo2": arch(cfg("Olmo2Config", **DECODER), {"Olmo2RMSNorm"}),
    "olmo3": arch(cfg("Olmo3Config", **DECODER), {"Olmo3RMSNorm"}),
    "cohere": arch(cfg("CohereConfig", **DECODER), {"CohereLayerNorm"}),
    "cohere2": arch(cfg("Cohere2Config", **DECODER), {"Cohere2LayerNorm"}),
    "granite": arch(cfg("GraniteConfig", **DECODER), {"GraniteRMSNorm"}),
    "glm": arch(cfg("GlmConfig", **DECODER, head_dim=8), {"GlmRMSNorm"}),
    "helium": arch(cfg("HeliumConfig", **DECODER, head_dim=8), {"HeliumRMSNorm"}),
    "exaone4": arch(cfg("Exaone4Config", **DECODER), {"Exaone4RMSNorm"}),
    "smollm3": arch(cfg("SmolLM3Config", **DECODER), {"SmolLM3RMSNorm"}),
    "bitnet": arch(cfg("BitNetConfig", **DECODER), {"BitNetRMSNorm"}),
    "lfm2": arch(cfg("Lfm2Config", **DECODER, layer_types=["conv", "full_attention"]),
                 {"Lfm2RMSNorm"}),
    "jamba": arch(cfg("JambaConfig", **DECODER, num_experts=2, num_experts_per_tok=1,
                      mamba_d_state=8, attn_layer_period=2, attn_layer_offset=1,
                      expert_layer_period=2, expert_layer_offset=1), {"JambaRMSNorm"}),
    "falcon_h1": arch(cfg("FalconH1Config", **DECODER, mamba_d_ssm=32, mamba_n_heads=4,
                          mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8),
                      {"FalconH1RMSNorm"}),
    "mamba": arch(cfg("MambaConfig", hidden_size=32, num_hidden_layers=2, state_size=8, **TOKENS),
                  {"MambaRMSNorm"}),
    # the gated norm's forward also takes the gate
    "mamba2": arch(cfg("Mamba2Config", hidden_size=32, num_hidden_layers=2, num_heads=4,
                       head_dim=16, state_size=8, n_groups=1, expand=2, **TOKENS),
                   {"Mamba2RMSNorm"}, {"MambaRMSNormGated"}),
    "zamba2": arch(cfg("Zamba2Config", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, mamba_d_state=8, mamba_ngroups=1, mamba_headdim=8,
                       n_mamba_heads=8, intermediate_size=64,
                       layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], **TOKENS),
                   {"Zamba2RMSNorm"}, {"Zamba2RMSNormGated"}),
    "starcoder2": arch(cfg("Starcoder2Config", **DECODER), {"LayerNorm"}),
    "stablelm": arch(cfg("StableLmConfig", **DECODER), {"LayerNorm"}),
    "persimmon": arch(cfg("PersimmonConfig", **DECODER), {"LayerNorm"}),
    "biogpt": arch(cfg("BioGptConfig", **DECODER), {"LayerNorm"}),
    # adds 1 to the weight in the weight's dtype: half inputs round 1 + w (offset_dtype="param")
    "nemotron": arch(cfg("NemotronConfig", **DECODER), set(), {"NemotronLayerNorm1P"}),
    "gpt2": arch(cfg("GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=64, **TOKENS),
                 {"LayerNorm"}),
    "gpt_neo": arch(cfg("GPTNeoConfig", hidden_size=32, num_layers=2, num_heads=4,
                        attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
                        **TOKENS), {"LayerNorm"}),
    "gpt_neox": arch(cfg("GPTNeoXConfig", **DECODER), {"LayerNorm"}),
    "gptj": arch(cfg("GPTJConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                     **TOKENS), {"LayerNorm"}),
    "codegen": arch(cfg("CodeGenConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                        n_positions=64, n_ctx=64, **TOKENS), {"LayerNorm"}),
    "falcon": arch(cfg("FalconConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       **TOKENS), {"LayerNorm"}),
    "opt": arch(cfg("OPTConfig", hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                    num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
                    **TOKENS), {"LayerNorm"}),
    "xglm": arch(cfg("XGLMConfig", d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                     max_position_embeddings=64, **TOKENS), {"LayerNorm"}),
    "bloom": arch(cfg("BloomConfig", hidden_size=32, n_layer=2, n_head=4, **TOKENS),
                  {"LayerNorm"}),
    "mpt": arch(cfg("MptConfig", d_model=32, n_layers=2, n_heads=4, max_seq_len=64, **TOKENS),
                {"LayerNorm"}),
    "t5": arch(cfg("T5Config", d_model=32, d_ff=64, d_kv=8, num_layers=1, num_decoder_layers=1,
                   num_heads=4, decoder_start_token_id=0, **TOKENS), {"T5LayerNorm"},
               seq2seq=True),
    "bart": arch(cfg("BartConfig", d_model=32, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=64, decoder_start_token_id=2,
                     forced_eos_token_id=None, **TOKENS), {"LayerNorm"}, seq2seq=True),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads; on a shared machine threads only wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def perturb_norms(model, generator):
    """Move every norm's parameters off their initial values (the init would hide the offset)."""
    with torch.no_grad():
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                for p in module.parameters(recurse=False):
                    p.add_(0.3 * torch.randn(p.shape, generator=generator))


def run(model, ids, seq2seq):
    with torch.no_grad():
        extra = {"decoder_input_ids": ids[:, :4]} if seq2seq else {}
        logits = model(input_ids=ids, **extra).logits
        tokens = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return logits, tokens


def to_numpy(tensor):
    return None if tensor is None else bridge("torch").to_numpy(tensor.detach())


def check_follows_spec(module, spec, shape, dtype, generator, what):
    """``module`` (its parameters in ``dtype``) against the reference for ``spec``."""
    module = copy.deepcopy(module).to(dtype)
    x = (3 * torch.randn(16, *shape, generator=generator)).to(dtype)
    with torch.no_grad():
        y = module(x)
    w, b = (to_numpy(getattr(module, name, None)) for name in ("weight", "bias"))
    xn = to_numpy(x)
    expected = reference.normalize(xn, spec, w, b)
    magnitude = reference.scaled_magnitude(xn, spec, w) if spec.scale else None
    tolerances.assert_close(to_numpy(y), expected, cast=spec.cast, what=what, magnitude=magnitude)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_swap_norms_keeps_a_tiny_models_tokens_and_logits(name):
    architecture = ARCHITECTURES[name]
    torch.manual_seed(0)
    auto = transformers.AutoModelForSeq2SeqLM if architecture.seq2seq else transformers.AutoModelForCausalLM
    model = auto.from_config(architecture.config()).eval()
    generator = torch.Generator().manual_seed(1)
    perturb_norms(model, generator)
    original = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (2, 6), generator=generator)
    before_logits, before_tokens = run(model, ids, architecture.seq2seq)

    same, report = swap_norms(model)

    assert same is model
    assert report.swapped_classes == architecture.swapped, report.describe()
    assert set(report.left_alone_classes) == architecture.left_alone, report.describe()
    after_logits, after_tokens = run(model, ids, architecture.seq2seq)
    assert torch.equal(after_tokens, before_tokens)
    assert after_tokens.shape[1] == (1 if architecture.seq2seq else ids.shape[1]) + NEW_TOKENS
    error = float((after_logits - before_logits).abs().max())
    assert error <= LOGITS_REL * float(before_logits.abs().max()), error
    first = {}
    for swap in report.swapped:
        first.setdefault(swap.original, swap)
    for swap in first.values():  # the spec found is the original's, and the swapped module's
        new = model.get_submodule(swap.path)
        assert isinstance(new, (RMSNorm, LayerNorm)) and new.spec == swap.spec
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for module in (original.get_submodule(swap.path), new):
                check_follows_spec(module, swap.spec, new.normalized_shape, dtype, generator,
                                   f"{swap.path} {type(module).__name__} {dtype}")
