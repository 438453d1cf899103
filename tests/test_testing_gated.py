"""assert_conforms on gated specs: ``fn(x, gate)`` gets its gate, and the gate's gradient is
checked (docs/semantics.md: no field is ever dropped)."""

import pytest

from normkit import NormSpec
from normkit.testing import assert_conforms

torch = pytest.importorskip("torch")

EPS = 1e-6
SMALL = {"shapes": ((5, 8), (3, 64))}


def rms(h):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


def gated_after(x, gate):
    """Qwen3-Next's order: the norm, then the SiLU gate, in float32, one rounding."""
    return (rms(x.float()) * torch.nn.functional.silu(gate.float())).to(x.dtype)


def gated_before(x, gate, weight, bias):
    """Mamba2's order: the gate, then the norm of the product."""
    h = x.float() * torch.nn.functional.silu(gate.float())
    return (rms(h) * weight.float()).to(x.dtype)


def sigmoid_after(x, gate):
    return (rms(x.float()) * torch.sigmoid(gate.float())).to(x.dtype)


def test_a_gated_function_gets_its_gate_and_conforms():
    assert_conforms(gated_after, NormSpec(gate="after"), backend="torch", **SMALL)
    assert_conforms(gated_before, NormSpec(gate="before"), backend="torch", params=True, **SMALL)


def test_the_gate_gradient_is_checked():
    def frozen_gate(x, gate):
        return gated_after(x, gate.detach())

    with pytest.raises(AssertionError) as info:
        assert_conforms(frozen_gate, NormSpec(gate="after"), backend="torch",
                        dtypes=("float32",), **SMALL)
    assert "float32[5, 8]: dgate: FAIL" in str(info.value)


def test_the_wrong_activation_is_named():
    with pytest.raises(AssertionError) as info:
        assert_conforms(sigmoid_after, NormSpec(gate="after"), backend="torch",
                        dtypes=("float32",), **SMALL)
    assert str(info.value).splitlines()[1].startswith(
        "Likely difference (identify's reading of sigmoid_after): gate_activation='sigmoid', "
        "not 'silu'"
    )


def test_groups_get_shapes_of_whole_groups():
    def grouped(x, gate):
        h = x.float().unflatten(-1, (-1, 4))
        return (rms(h).flatten(-2) * torch.nn.functional.silu(gate.float())).to(x.dtype)

    spec = NormSpec(gate="after", group_size=4)
    assert_conforms(grouped, spec, backend="torch")  # the default shapes hold whole groups
    with pytest.raises(ValueError, match="group_size=4 does not divide the normalized size n=7"):
        assert_conforms(grouped, spec, backend="torch", shapes=((5, 7),))
