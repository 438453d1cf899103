"""normkit.port.huggingface.swap_norms: every norm recognised by probing, outputs unchanged.

Tiny, locally configured Hugging Face models (no downloads): each is built from a seeded random
init, its norms' parameters moved off their initial values, then swapped; greedy ``generate``
gives the same tokens and the logits stay within `LOGITS_REL`.
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from normkit import NormSpec, reference, tolerances  # noqa: E402
from normkit.backends import bridge  # noqa: E402
from normkit.port.huggingface import LeftAlone, Swap, SwapReport, swap_norms  # noqa: E402
from normkit.torch import GatedRMSNorm, LayerNorm, RMSNorm  # noqa: E402

# A swapped norm is within normkit's float32 bound of the original (FORWARD_REL of max|y|); the
# logits pass through up to five norms and the layers between them, each of which can scale that
# relative error by a small factor: 10 times the per-norm bound, the same 1e-5 Hugging Face's own
# cross-framework equivalence tests use in float32 (measured here: at most 5e-7).
LOGITS_REL = 10 * tolerances.FORWARD_REL
NEW_TOKENS = 8
VOCAB = 100
TOKENS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, **TOKENS)

# the hybrid models' pieces, each as small as its config allows
HYBRID = ["linear_attention", "full_attention"]
LINEAR_ATTENTION = dict(layer_types=HYBRID, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
SMALL_MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32)
MOE_DECODER = {k: v for k, v in DECODER.items() if k != "intermediate_size"}
MLA_DECODER = {**DECODER, "num_key_value_heads": 4}
SMALL_MLA = dict(layer_types=HYBRID, moe_intermediate_size=32, num_local_experts=2,
                 num_experts_per_tok=1, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                 v_head_dim=8)
FALCON_H1_GATED = dict(**DECODER, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
                       mamba_d_state=8, mamba_rms_norm=True)
INDEXED = ["linear_attention", "indexed_attention"]
QWEN4_EXP = dict(**MOE_DECODER, head_dim=8, **{**LINEAR_ATTENTION, "layer_types": INDEXED},
                 **SMALL_MOE, hc_count=2, hc_lowrank=4, indexer_n_heads=2, indexer_kv_heads=1,
                 indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2)
GLM5_NEXT_TEXT = dict(**MLA_DECODER, moe_intermediate_size=32, layer_types=INDEXED,
                      mlp_layer_types=["dense", "sparse"], n_routed_experts=2, num_experts_per_tok=1,
                      kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
                      index_topk=4, index_kpool=2, index_head_dim=8, index_n_heads=2,
                      linear_head_dim=8, linear_num_heads=4, hc_mult=2)
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=32, intermediate_size=32,
                   projection_intermediate_size=32, image_size=28, patch_size=14)


@dataclass(frozen=True)
class Architecture:
    config: Callable[[], object]
    swapped: frozenset[str]
    left_alone: frozenset[str]
    seq2seq: bool
    auto: str | None = None  # the Auto class that builds it, where not the CausalLM/Seq2SeqLM one


def arch(config, swapped, left_alone=(), seq2seq=False, auto=None):
    return Architecture(config, frozenset(swapped), frozenset(left_alone), seq2seq, auto)


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
    # gated norms: module(x, gate), the gate before the norm, a statistic per group
    "mamba2": arch(cfg("Mamba2Config", hidden_size=32, num_hidden_layers=2, num_heads=4,
                       head_dim=16, state_size=8, n_groups=2, expand=2, **TOKENS),
                   {"Mamba2RMSNorm", "MambaRMSNormGated"}),
    "zamba2": arch(cfg("Zamba2Config", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, mamba_d_state=8, mamba_ngroups=1, mamba_headdim=8,
                       n_mamba_heads=8, intermediate_size=64,
                       layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], **TOKENS),
                   {"Zamba2RMSNorm", "Zamba2RMSNormGated"}),
    "bamba": arch(cfg("BambaConfig", **DECODER, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
                      mamba_d_state=8, mamba_chunk_size=16, attn_layer_indices=[1]),
                  {"BambaRMSNorm", "BambaRMSNormGated"}),
    "nemotron_h": arch(cfg("NemotronHConfig", **DECODER, head_dim=8,
                           layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                           mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=16),
                       {"NemotronHRMSNorm", "NemotronHRMSNormGated"}),
    "granitemoehybrid": arch(cfg("GraniteMoeHybridConfig", **DECODER,
                                 layer_types=["mamba", "attention"], num_local_experts=2,
                                 num_experts_per_tok=1, shared_intermediate_size=64,
                                 mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
                                 mamba_chunk_size=16),
                             {"GraniteMoeHybridRMSNorm", "GraniteMoeHybridRMSNormGated"}),
    # mamba_rms_norm=True switches the gated norm on (the plain falcon_h1 above has none); the gate
    # after the norm (norm_before_gate, the default) and before it, each with 2 groups
    "falcon_h1_gated": arch(cfg("FalconH1Config", **FALCON_H1_GATED),
                            {"FalconH1RMSNorm", "FalconH1RMSNormGated"}),
    "falcon_h1_gate_before": arch(cfg("FalconH1Config", **FALCON_H1_GATED,
                                      mamba_norm_before_gate=False),
                                  {"FalconH1RMSNorm", "FalconH1RMSNormGated"}),
    # gated norms after the norm, on the linear-attention (gated delta rule, KDA) heads' outputs;
    # transformers' pure-torch fallbacks stand in for flash-linear-attention and causal_conv1d
    "qwen3_next": arch(cfg("Qwen3NextConfig", **DECODER, head_dim=8, **LINEAR_ATTENTION, **SMALL_MOE),
                       {"Qwen3NextRMSNorm", "Qwen3NextRMSNormGated"}),
    "qwen3_5": arch(cfg("Qwen3_5TextConfig", **DECODER, head_dim=8, **LINEAR_ATTENTION),
                    {"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"}),
    "qwen3_5_moe": arch(cfg("Qwen3_5MoeTextConfig", **MOE_DECODER, head_dim=8, **LINEAR_ATTENTION,
                            **SMALL_MOE),
                        {"Qwen3_5MoeRMSNorm", "Qwen3_5MoeRMSNormGated"}),
    "olmo_hybrid": arch(cfg("OlmoHybridConfig", **DECODER, **LINEAR_ATTENTION),
                        {"OlmoHybridRMSNorm", "OlmoHybridRMSNormGated"}),
    "lara_mini": arch(cfg("LaraMiniConfig", **DECODER, head_dim=8, **LINEAR_ATTENTION, **SMALL_MOE),
                      {"LaraMiniRMSNorm", "LaraMiniRMSNormGated"}),
    # the gate's activation is the config's output_gate_type (else hidden_act): SiLU and sigmoid.
    # Its grouped RMSNorm over the hc_count residual streams (Qwen4ExpTextRMSNorm(group_size=
    # hidden_size), 5 of its 9) is left alone: identify does not probe groups of an ungated norm
    "qwen4_exp": arch(cfg("Qwen4ExpTextConfig", **QWEN4_EXP),
                      {"Qwen4ExpTextRMSNorm", "Qwen4ExpTextRMSNormGated"}, {"Qwen4ExpTextRMSNorm"}),
    "qwen4_exp_sigmoid": arch(cfg("Qwen4ExpTextConfig", **QWEN4_EXP, output_gate_type="sigmoid"),
                              {"Qwen4ExpTextRMSNorm", "Qwen4ExpTextRMSNormGated"},
                              {"Qwen4ExpTextRMSNorm"}),
    # sigmoid gates, affine in float32 (MLA attention: as many key/value heads as query heads)
    "kimi_linear": arch(cfg("KimiLinearConfig", **MLA_DECODER, **SMALL_MLA, linear_head_dim=8,
                            linear_num_heads=4),
                        {"KimiLinearRMSNorm", "KimiLinearRMSNormGated"}),
    "bailing_hybrid": arch(cfg("BailingHybridConfig", **MLA_DECODER, **SMALL_MLA, head_dim=8,
                               n_group=1, topk_group=1, first_k_dense_replace=1, num_mtp_layers=0),
                           {"BailingHybridRMSNorm", "BailingHybridRMSNormGated"}),
    # image-text-to-text only (no CausalLM class): text-only generate with a one-block vision tower;
    # its weightless RMSNorm (the hyper-connections' streams) has no size to tell
    "glm5_next": arch(cfg("Glm5NextConfig", text_config=GLM5_NEXT_TEXT, vision_config=TINY_VISION),
                      {"Glm5NextRMSNorm", "Glm5NextTextRMSNorm", "Glm5NextTextRMSNormGated",
                       "LayerNorm"},
                      {"Glm5NextTextUnweightedRMSNorm"}, auto="AutoModelForImageTextToText"),
    "starcoder2": arch(cfg("Starcoder2Config", **DECODER), {"LayerNorm"}),
    "stablelm": arch(cfg("StableLmConfig", **DECODER), {"LayerNorm"}),
    "persimmon": arch(cfg("PersimmonConfig", **DECODER), {"LayerNorm"}),
    "biogpt": arch(cfg("BioGptConfig", **DECODER), {"LayerNorm"}),
    # adds 1 to the weight in the weight's dtype: half inputs round 1 + w (offset_dtype="param")
    "nemotron": arch(cfg("NemotronConfig", **DECODER), {"NemotronLayerNorm1P"}, set()),
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
    z = (2 * torch.randn(16, *shape, generator=generator)).to(dtype)
    with torch.no_grad():
        y = module(x) if spec.gate is None else module(x, z)
    w, b = (to_numpy(getattr(module, name, None)) for name in ("weight", "bias"))
    xn, zn = to_numpy(x), (None if spec.gate is None else to_numpy(z))
    if zn is None:
        expected = reference.normalize(xn, spec, w, b)
    else:
        expected = reference.gated_normalize(xn, zn, spec, w, b)
    magnitude = reference.scaled_magnitude(xn, spec, w, gate=zn) if spec.scale else None
    tolerances.assert_close(to_numpy(y), expected, cast=spec.cast, what=what, magnitude=magnitude)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_swap_norms_keeps_a_tiny_models_tokens_and_logits(name):
    architecture = ARCHITECTURES[name]
    torch.manual_seed(0)
    auto = transformers.AutoModelForSeq2SeqLM if architecture.seq2seq else transformers.AutoModelForCausalLM
    auto = getattr(transformers, architecture.auto) if architecture.auto else auto
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
        assert isinstance(new, (RMSNorm, GatedRMSNorm, LayerNorm)) and new.spec == swap.spec
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for module in (original.get_submodule(swap.path), new):
                check_follows_spec(module, swap.spec, new.normalized_shape, dtype, generator,
                                   f"{swap.path} {type(module).__name__} {dtype}")


@pytest.mark.parametrize("name", ["LlamaRMSNorm", "GemmaRMSNorm", "Qwen3RMSNorm", "Gemma3RMSNorm",
                                  "T5LayerNorm", "CohereLayerNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swapped_hf_norms_are_bit_exact_in_half_precision(name, dtype):
    family = name.removesuffix("RMSNorm").removesuffix("LayerNorm").lower()
    module = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    generator = torch.Generator().manual_seed(1)
    original = module(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        original.weight.copy_(torch.randn(32, generator=generator))
    x = (3 * torch.randn(4, 7, 32, generator=generator)).to(dtype)
    swapped, report = swap_norms(copy.deepcopy(original))
    assert report.swapped[0].path == "" and isinstance(swapped, (RMSNorm, LayerNorm))
    assert swapped.weight.dtype == dtype
    with torch.no_grad():
        assert torch.equal(swapped(x), original(x))


def test_swap_norms_replaces_torch_layer_norms_and_rms_norms():
    generator = torch.Generator().manual_seed(2)
    model = nn.Sequential(
        nn.LayerNorm(16, eps=1e-5), nn.RMSNorm(16), nn.LayerNorm(16, bias=False),
        nn.RMSNorm([4, 16], eps=1e-3, elementwise_affine=False), nn.LayerNorm(16, elementwise_affine=False),
        nn.LayerNorm([4, 16], eps=1e-12),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    model[0].bias.requires_grad_(False)
    model[2].train(False)
    x = torch.randn(3, 4, 16, generator=generator)
    with torch.no_grad():
        before = [m(x) for m in model]
        same, report = swap_norms(model)
        after = [m(x) for m in model]
    assert same is model and report.left_alone == ()
    assert [s.spec for s in report.swapped] == [
        NormSpec("layer", eps=1e-5),
        NormSpec("rms", eps=torch.finfo(torch.float32).eps),
        NormSpec("layer", eps=1e-5, bias=False),
        NormSpec("rms", eps=1e-3, axis=(-2, -1), scale=False),
        NormSpec("layer", eps=1e-5, scale=False, bias=False),
        NormSpec("layer", eps=1e-12, axis=(-2, -1)),
    ]
    assert [s.eps_from for s in report.swapped] == ["module.eps", "torch eps=None"] + ["module.eps"] * 4
    assert isinstance(model[0], LayerNorm) and not model[0].bias.requires_grad
    assert model[0].weight.requires_grad and model[1].training and not model[2].training
    for b, a in zip(before, after, strict=True):
        tolerances.assert_close(a.numpy(), b.double().numpy())


def test_a_norm_at_the_root_and_a_shared_norm_are_replaced():
    swapped, report = swap_norms(nn.LayerNorm(8))
    assert isinstance(swapped, LayerNorm) and [s.path for s in report.swapped] == [""]
    shared = nn.RMSNorm(8, eps=1e-6)
    model = nn.Sequential(shared, nn.Linear(8, 8), shared)
    _, report = swap_norms(model)
    assert [s.path for s in report.swapped] == ["0", "2"] and model[0] is model[2]
    assert isinstance(model[0], RMSNorm)


class ScaledRMSNorm(nn.Module):
    """An RMSNorm in the Gemma style, eps fixed in the code: ``x / rms * (1 + weight)``."""

    def __init__(self, n, eps_attribute=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        if eps_attribute is not None:
            self.eps = eps_attribute

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return (normed * (1 + self.weight.float())).type_as(x)


def test_eps_comes_from_the_module_else_the_config_else_the_measurement():
    config = transformers.LlamaConfig(rms_norm_eps=1e-5)
    _, report = swap_norms(nn.Sequential(ScaledRMSNorm(8)), config=config)
    assert report.swapped == (Swap("0", "ScaledRMSNorm", NormSpec("rms", eps=1e-5, scale_offset=1.0), "config.rms_norm_eps"),)
    # an attribute or a config value the module does not use is passed over
    _, report = swap_norms(nn.Sequential(ScaledRMSNorm(8, eps_attribute=1e-3)), config=transformers.LlamaConfig(rms_norm_eps=1e-6))
    assert report.swapped[0].eps_from == "measured" and report.swapped[0].spec.eps == pytest.approx(1e-5, rel=1e-4)
    _, report = swap_norms(nn.Sequential(ScaledRMSNorm(8, eps_attribute=1e-5)), config=config)
    assert report.swapped[0].eps_from == "module.eps"


class MaskedRMSNorm(nn.Module):
    """Takes a second input that is not a gate."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x, mask=None):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return y if mask is None else y * mask


class ShiftedRMSNorm(nn.LayerNorm):
    """Has a third parameter."""

    def __init__(self, n):
        super().__init__(n)
        self.shift = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return super().forward(x) + self.shift


class UnweightedRMSNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class MismatchedLayerNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n + 1))

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias[:-1])


class TanhNorm(nn.Module):
    """Elementwise, not a norm."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return torch.tanh(x) * self.weight


class Float32RMSNorm(nn.Module):
    """Returns float32 for every input (no cast back)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        x = x.float()
        return self.weight.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class HalfAffineLayerNorm(nn.Module):
    """Normalizes in float32, then multiplies and adds in the input dtype (two roundings)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        y = nn.functional.layer_norm(x.float(), x.shape[-1:], eps=1e-5).to(x.dtype)
        return self.weight * y + self.bias


class IdleWeightRMSNorm(UnweightedRMSNorm):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class ApproximateRMSNorm(nn.Module):
    """An RMSNorm whose float32 path is 2^-12 off (as with an approximate rsqrt): within
    identify's 1% check, not within normkit's float32 bound."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = 1e-5

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if x.dtype == torch.float32:
            y = y * (1 + 2**-12)
        return (y * self.weight.float()).type_as(x)


LEFT_ALONE = {
    MaskedRMSNorm: r"its forward\(x, mask=None\) takes more than the input \(and not a gate\)",
    ShiftedRMSNorm: r"it has parameters other than weight and bias: \['shift'\]",
    UnweightedRMSNorm: r"it has no weight, bias or normalized_shape, so its normalized size is unknown",
    MismatchedLayerNorm: r"its weight and bias have different shapes: \[\(8,\), \(9,\)\]",
    TanhNorm: r"identify finds kind='dyt' \(alpha 1\): swap_norms replaces RMSNorm, partial RMSNorm and LayerNorm only",
    Float32RMSNorm: (r"it returns float32 for bfloat16 inputs, float32 for float16 inputs with parameters "
                     r"in the input's dtype"),
    HalfAffineLayerNorm: (r"identify could not determine cast: bfloat16 input: .*cast undetermined: "
                          r"closer to before_scale than to after_scale on \d+% .*error \d+ ulp"),
    IdleWeightRMSNorm: r"identify finds scale=False, bias=False, but its parameters are \['weight'\]",
    ApproximateRMSNorm: (r"no eps reproduces its float32 outputs: module.eps = 1e-05 \(error 0.00024 max_abs / max\|ref\|, "
                         r"bound 1e-06\); measured = 1e-05 \(error 0.00024 "),
}


@pytest.mark.parametrize("cls", list(LEFT_ALONE), ids=lambda cls: cls.__name__)
def test_a_norm_that_is_not_pinned_is_left_alone_with_the_reason(cls):
    module = cls(8) if cls is not UnweightedRMSNorm else cls()
    model = nn.Sequential(nn.Linear(8, 8), module)
    _, report = swap_norms(model)
    assert model[1] is module and report.swapped == ()
    assert [(e.path, e.original) for e in report.left_alone] == [("1", cls.__name__)]
    assert re.match(LEFT_ALONE[cls], report.left_alone[0].reason), report.left_alone[0].reason


def test_the_report_lists_each_class_once_with_its_count():
    model = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8), MaskedRMSNorm(8), nn.BatchNorm1d(8), nn.Linear(8, 8))
    _, report = swap_norms(model)
    assert isinstance(report, SwapReport) and report.swapped_classes == {"LayerNorm"}
    masked = "its forward(x, mask=None) takes more than the input (and not a gate)"
    assert report.left_alone[0] == LeftAlone("2", "MaskedRMSNorm", masked)
    assert set(report.left_alone_classes) == {"MaskedRMSNorm", "BatchNorm1d"}
    lines = report.describe().splitlines()
    assert lines[0].startswith("LayerNorm: 2 swapped as NormSpec('layer', eps=1e-05)")
    assert lines[1].startswith("BatchNorm1d: 1 left alone: identify: ")
    assert lines[2] == f"MaskedRMSNorm: 1 left alone: {masked}"


HF_RMS_CLASSES = ["LlamaRMSNorm", "GemmaRMSNorm", "Qwen3RMSNorm", "Gemma3RMSNorm", "T5LayerNorm"]


@pytest.mark.parametrize("name", HF_RMS_CLASSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swapped_hf_rms_norms_are_bit_exact_on_millions_of_elements(name, dtype):
    """Enough rows to meet rounding ties (the CPU kernel flipped about one float16 row in
    2,000-4,000 at n = 4: LlamaRMSNorm(4) on [-0.8916015625, 1.5205078125, -3.962890625,
    -0.3095703125] gave -1.822265625 where swapped gave -1.8232421875), initial and random weights,
    2**20 rows of 4 and 256 rows of 4096."""
    family = name.removesuffix("RMSNorm").removesuffix("LayerNorm").lower()
    module = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    generator = torch.Generator().manual_seed(4)
    issue_row = torch.tensor([-0.8916015625, 1.5205078125, -3.962890625, -0.3095703125])
    for rows, n, random_weight in ((2**20, 4, False), (256, 4096, True)):
        original = module(n, eps=1e-6).to(dtype)
        if random_weight:
            with torch.no_grad():
                original.weight.add_((0.5 * torch.randn(n, generator=generator)).to(dtype))
        x = (3 * torch.randn(rows, n, generator=generator)).to(dtype)
        if n == 4:
            x[0] = issue_row.to(dtype)
        swapped, report = swap_norms(copy.deepcopy(original))
        assert isinstance(swapped, RMSNorm) and swapped.kernel == "composite", report.describe()
        with torch.no_grad():
            want, got = original(x), swapped(x)
        different = int((want != got).any(-1).sum())
        assert different == 0, f"{name} {dtype} {rows}x{n}: {different} rows differ"


def test_swap_norms_kernel_argument_builds_that_kernel():
    """kernel="auto" (normkit's CPU kernel on the CPU) is faster but only within the policy:
    on the issue's float16 row it rounds y_hat from the exact statistic."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from normkit.bridges import TorchBridge

    to_numpy = TorchBridge().to_numpy

    original = LlamaRMSNorm(4, eps=1e-6).to(torch.float16)
    swapped, _ = swap_norms(copy.deepcopy(original), kernel="auto")
    assert swapped.kernel == "auto"
    x = torch.tensor([[-0.8916015625, 1.5205078125, -3.962890625, -0.3095703125]],
                     dtype=torch.float16)
    with torch.no_grad():
        got = swapped(x)
    expected = reference.normalize(to_numpy(x), swapped.spec, to_numpy(swapped.weight.detach()))
    tolerances.assert_close(to_numpy(got), expected, cast="before_scale",
                            magnitude=reference.scaled_magnitude(to_numpy(x), swapped.spec))
    with pytest.raises(ValueError, match="kernel='fast' is invalid"):
        swap_norms(copy.deepcopy(original), kernel="fast")
