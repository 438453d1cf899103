"""normkit.port.torch.swap_norms: torch's and Hugging Face's norms replaced, outputs unchanged."""

from __future__ import annotations

import importlib
import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from normkit import NormSpec, tolerances  # noqa: E402
from normkit.port.torch import HF_STYLES, Swap, swap_norms  # noqa: E402
from normkit.torch import LayerNorm, RMSNorm  # noqa: E402

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)

# What each style's forward does, as its source says it (see HF_STYLES).
STYLE_SOURCE = {
    "llama": "self.weight * hidden_states.to(input_dtype)",
    "gemma": "output * (1.0 + self.weight.float())",
}


def hf_class(name):
    family = name.removesuffix("RMSNorm").removesuffix("LayerNorm").lower()
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


@pytest.mark.parametrize("name", sorted(HF_STYLES))
def test_the_style_table_matches_the_installed_transformers(name):
    source = inspect.getsource(hf_class(name).forward)
    if name == "T5LayerNorm":  # casts to the weight's dtype when half, then multiplies
        assert "hidden_states.to(self.weight.dtype)" in source and "self.weight * hidden_states" in source
    else:
        assert STYLE_SOURCE[HF_STYLES[name]] in source


def randomize_norms(model, center, generator):
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(center + 0.2 * torch.randn(module.weight.shape, generator=generator))


def logits_before_and_after(model, style_center):
    generator = torch.Generator().manual_seed(0)
    randomize_norms(model, style_center, generator)
    model.eval()
    ids = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=generator)
    with torch.no_grad():
        before = model(ids).logits
        _, swaps = swap_norms(model)
        after = model(ids).logits
    return before, after, swaps


def test_swap_norms_on_a_llama_model_leaves_the_logits_unchanged():
    config = transformers.LlamaConfig(**SIZES, rms_norm_eps=1e-5)
    before, after, swaps = logits_before_and_after(transformers.LlamaForCausalLM(config), 1.0)
    assert len(swaps) == 2 * 2 + 1 and {s.original for s in swaps} == {"LlamaRMSNorm"}
    assert swaps[-1] == Swap("model.norm", "LlamaRMSNorm", NormSpec("rms", eps=1e-5, cast="before_scale"))
    assert "model.layers.1.post_attention_layernorm" in [s.path for s in swaps]
    assert float((after - before).abs().max()) <= 1e-5
    assert before.abs().max() > 0.1  # the logits are not trivially small


def test_swap_norms_on_a_gemma_model_leaves_the_logits_unchanged():
    config = transformers.GemmaConfig(**SIZES, head_dim=16, rms_norm_eps=1e-6)
    model = transformers.GemmaForCausalLM(config)
    before, after, swaps = logits_before_and_after(model, 0.0)
    assert len(swaps) == 5 and swaps[0].spec == NormSpec("rms", eps=1e-6, scale_offset=1.0)
    assert isinstance(model.model.layers[0].input_layernorm, RMSNorm)
    assert float((after - before).abs().max()) <= 1e-5
    assert before.abs().max() > 0.1


@pytest.mark.parametrize("name", ["LlamaRMSNorm", "GemmaRMSNorm", "Qwen3RMSNorm", "Gemma3RMSNorm", "T5LayerNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swapped_hf_norms_are_bit_exact_in_half_precision(name, dtype):
    generator = torch.Generator().manual_seed(1)
    module = hf_class(name)(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(32, generator=generator))
    x = (3 * torch.randn(4, 7, 32, generator=generator)).to(dtype)
    swapped, swaps = swap_norms(module)
    assert swaps[0].path == "" and isinstance(swapped, RMSNorm)
    assert swapped.weight.dtype == dtype
    with torch.no_grad():
        assert torch.equal(swapped(x), module(x))


def test_swap_norms_replaces_torch_layer_norms_and_rms_norms():
    generator = torch.Generator().manual_seed(2)
    model = nn.Sequential(
        nn.LayerNorm(16, eps=1e-5), nn.RMSNorm(16), nn.LayerNorm(16, bias=False),
        nn.RMSNorm([4, 16], eps=1e-3, elementwise_affine=False), nn.LayerNorm(16, elementwise_affine=False),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    model[0].bias.requires_grad_(False)
    x = torch.randn(3, 4, 16, generator=generator)
    with torch.no_grad():
        before = [m(x) for m in model]
        same, swaps = swap_norms(model)
        after = [m(x) for m in model]
    assert same is model
    assert [s.spec for s in swaps] == [
        NormSpec("layer", eps=1e-5),
        NormSpec("rms", eps=torch.finfo(torch.float32).eps),
        NormSpec("layer", eps=1e-5, bias=False),
        NormSpec("rms", eps=1e-3, axis=(-2, -1), scale=False),
        NormSpec("layer", eps=1e-5, scale=False, bias=False),
    ]
    assert isinstance(model[0], LayerNorm) and not model[0].bias.requires_grad
    for b, a in zip(before, after, strict=True):
        tolerances.assert_close(a.numpy(), b.double().numpy())


def test_swap_norms_eps_stands_for_torch_rms_norms_eps_none():
    _, swaps = swap_norms(nn.Sequential(nn.RMSNorm(8), nn.RMSNorm(8, eps=1e-4)), eps=1e-6)
    assert [s.spec.eps for s in swaps] == [1e-6, 1e-4]


class MyRMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.eps = 1e-6

    def forward(self, x):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)).type_as(x)


def test_an_unknown_rms_norm_class_is_refused_unless_its_style_is_given():
    model = nn.Sequential(nn.Linear(8, 8), MyRMSNorm(8))
    with pytest.raises(ValueError, match=r"1 \(MyRMSNorm\): unknown RMSNorm class; its cast order and "
                       r"offset decide its outputs. Known: \['Gemma2RMSNorm'.*; pass "
                       r"styles=\{'MyRMSNorm': 'llama' or 'gemma'\}"):
        swap_norms(model)
    assert isinstance(model[1], MyRMSNorm)  # nothing was swapped before the error
    x = torch.randn(2, 8)
    with torch.no_grad():
        model[1].weight.normal_()
        before = model(x)
        _, swaps = swap_norms(model, styles={"MyRMSNorm": "gemma"})
        tolerances.assert_close(model(x).numpy(), before.double().numpy())
    assert swaps == [Swap("1", "MyRMSNorm", NormSpec("rms", scale_offset=1.0))]


def test_swap_norms_errors_name_the_module():
    with pytest.raises(ValueError, match=r"<root> \(MyRMSNorm\): style 't5' is not 'llama' or 'gemma'"):
        swap_norms(MyRMSNorm(4), styles={"MyRMSNorm": "t5"})
    broken = MyRMSNorm(4)
    broken.eps = None
    with pytest.raises(ValueError, match=r"<root> \(MyRMSNorm\): expected a float eps \(or "
                       r"variance_epsilon\) and a 1-d weight, got eps None and weight \(4,\)"):
        swap_norms(broken, styles={"MyRMSNorm": "gemma"})
