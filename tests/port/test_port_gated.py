"""Each Hugging Face gated norm class against normkit's GatedRMSNorm: the same output bits.

For every class of `normkit.port.gated_classes.GATED_CLASSES` in the installed transformers
(hidden size 64; the grouped ones with 4 groups of 16 and with one group over the row), the HF
module and normkit's module for the table's spec, its weight copied, are called on the same x
and gate: float32, bfloat16 and float16 inputs, the weight in the input's dtype and in float32
(a model's master weights under mixed precision), in inference (no_grad: normkit's
`NormFunction` statistic) and with autograd recording (the weight requires grad: normkit's eager
op sequence). Both outputs are within normkit's tolerance policy of the float64 reference, and
on 4096 rows every output is bit-identical to the HF module's, -0.0 included (measured on
transformers 5.24, torch 2.13 CPU, one and two threads; also at hidden 128 and 2048):

=============================================  =======  ==============  ==============
class (setting)                                float32  bfloat16        float16
                                                        w bf16 / f32    w f16 / f32
=============================================  =======  ==============  ==============
Mamba2 family (5 classes), groups of 16 / row  bit      bit / bit       bit / bit
Qwen3-Next family (4 classes), Qwen4-Exp x2    bit      bit / bit       bit / bit
Kimi Linear, GLM-5-Next, Bailing, LaraMini     bit      bit / bit       bit / bit
Falcon-H1 (gate after / before), 4 groups / 1  bit      bit / bit       bit / bit
=============================================  =======  ==============  ==============

Why every case is bit-identical rather than within a few ulps: each step is the same torch op
in the same dtype on both sides. The statistic is ``x.pow(2).mean(-1)`` in HF and in normkit's
recording path, ``torch.linalg.vecdot(x, x) / k`` in its no_grad path; on the CPU vecdot is
``sum(x * x)`` (``pow(2)`` squares by multiplying, ``mean`` is ``sum / k``: the same products
and the same inner-dim reduction), whereas a matmul-based dot (``einsum``, ``bmm``) sums in
another order and gives another float32 statistic on most rows (2916 of 4096 rows of 64). The
normalization is ``x * rsqrt(s + eps)`` in float32 on both sides; the gate's activation the
same ``silu``/``sigmoid`` of the float32 gate; and normkit rounds where each class rounds (the
table's ``cast``: ``y_hat`` to the input dtype before the weight for the Mamba2 and Qwen3-Next
families, that product again before the gate for Qwen3-Next, once at the end for Kimi and
Falcon-H1), multiplying in the same order, so each rounding sees the same float32 value.

Not compared: rows whose mean square is below about 1e-31 or whose rsqrt leaves [2**-32, 2**32]
(normkit recomputes them in scaled units, where float32 may have lost their statistic; the HF
classes do not), and gradients (normkit's backward is analytic, HF's autograd's).

`swap_norms` builds its own spec by probing, and there it differs from the table: see
`test_swap_norms_gives_each_hf_gated_class_its_table_spec`.
"""

from __future__ import annotations

import copy
import importlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from normkit import reference, tolerances  # noqa: E402
from normkit.backends import bridge  # noqa: E402
from normkit.dtypes import is_half  # noqa: E402
from normkit.port.gated_classes import GATED_CLASSES, GatedClass  # noqa: E402
from normkit.port.huggingface import swap_norms  # noqa: E402
from normkit.torch import GatedRMSNorm, from_spec  # noqa: E402

HIDDEN = 64
EPS = 1e-6
SHAPE = (4, 1024, HIDDEN)  # 4096 rows, as a (batch, sequence, features) activation
GROUPED = {"group_size": 16, "n_groups": 4}  # 4 groups of 16 either way
WHOLE_ROW = {"group_size": HIDDEN, "n_groups": 1}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _groupings(entry: GatedClass) -> list[int | None]:
    return [None] if entry.groups is None else [GROUPED[entry.groups], WHOLE_ROW[entry.groups]]


def _setting_id(setting: tuple[GatedClass, int | None]) -> str:
    entry, groups = setting
    options = "".join(f"-{name}={value}" for name, value in entry.options)
    return entry.name + options + ("" if groups is None else f"-{entry.groups}={groups}")


SETTINGS = [(entry, groups) for entry in GATED_CLASSES for groups in _groupings(entry)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Rows are independent; on a shared machine more threads only wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_module(entry: GatedClass, groups: int | None) -> torch.nn.Module:
    """The HF class built with hidden size 64 (and ``groups``), its weight off 1, float32."""
    try:
        cls = getattr(importlib.import_module(entry.module), entry.name)
    except (ImportError, AttributeError):
        pytest.skip(f"{entry.module}.{entry.name} is not in the installed transformers")
    options = dict(entry.options)
    if entry.groups is not None:
        options[entry.groups] = groups
    module = cls(HIDDEN, eps=EPS, **options)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(HIDDEN, generator=generator))
    return module


def inputs(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x with rows of sizes from 2**-8 to 2**8, and a gate from about -8 to 8."""
    generator = torch.Generator().manual_seed(seed)
    rows = 2.0 ** torch.randint(-8, 9, (*SHAPE[:-1], 1), generator=generator)
    x = (3 * torch.randn(SHAPE, generator=generator) * rows).to(dtype)
    z = (2.5 * torch.randn(SHAPE, generator=generator)).to(dtype)
    return x, z


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def differing_rows(want: torch.Tensor, got: torch.Tensor) -> int:
    return int((bits(want) != bits(got)).reshape(-1, HIDDEN).any(-1).sum())


def to_numpy(t: torch.Tensor):
    return bridge("torch").to_numpy(t.detach())


def policy_check(x, z, spec, weight):
    """A check of an output against the float64 reference under `normkit.tolerances`: with a
    half x and ``cast="before_scale"`` in ulps of x's dtype (where y_hat is rounded, even when
    the output is promoted to float32) at the size of the rounded term."""
    xn, zn, w = to_numpy(x), to_numpy(z), to_numpy(weight)
    expected = reference.gated_normalize(xn, zn, spec, w)
    half_cast = is_half(xn.dtype) and spec.cast == "before_scale"
    dtype = xn.dtype if half_cast else None
    magnitude = reference.scaled_magnitude(xn, spec, w, gate=zn) if half_cast else None

    def check(y, what):
        tolerances.assert_close(to_numpy(y), expected, dtype=dtype, cast=spec.cast, what=what,
                                magnitude=magnitude)

    return check


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("setting", SETTINGS, ids=_setting_id)
def test_hf_gated_norm_and_its_table_spec_are_bit_identical(setting, dtype):
    entry, groups = setting
    original = hf_module(entry, groups)
    spec = entry.spec_for(HIDDEN, EPS, groups)
    ours = from_spec(spec, HIDDEN, kernel="composite")
    assert isinstance(ours, GatedRMSNorm)
    with torch.no_grad():
        ours.weight.copy_(original.weight)
    x, z = inputs(dtype, seed=DTYPES.index(dtype))
    for weight_dtype in dict.fromkeys([dtype, torch.float32]):
        a, b = copy.deepcopy(original).to(weight_dtype), copy.deepcopy(ours).to(weight_dtype)
        within_policy = policy_check(x, z, spec, a.weight)
        for recording in (False, True):
            case = f"{_setting_id(setting)} x {dtype} weight {weight_dtype} grad {recording}"
            with torch.set_grad_enabled(recording):
                want, got = a(x, z).detach(), b(x, z).detach()
            assert got.dtype == want.dtype, f"{case}: {got.dtype}, HF {want.dtype}"
            within_policy(want, f"{case} HF")
            within_policy(got, f"{case} normkit")
            assert differing_rows(want, got) == 0, (
                f"{case}: {differing_rows(want, got)} of {x.numel() // HIDDEN} rows differ"
            )
        if entry.gate_optional:  # forward(x): the same grouped norm without its gate
            with torch.no_grad():
                want, got = a(x), b(x)
            assert got.dtype == want.dtype and differing_rows(want, got) == 0, (
                f"{_setting_id(setting)} no gate, x {dtype} weight {weight_dtype}"
            )


@pytest.mark.parametrize("setting", SETTINGS, ids=_setting_id)
def test_swap_norms_gives_each_hf_gated_class_its_table_spec(setting):
    """swap_norms on the module as a model holds it (a float32 weight): a GatedRMSNorm with the
    table's spec, and the HF module's output (dtype and bits) for every input dtype. The
    Mamba2 family returns float32 for half inputs with a float32 weight (the table's
    ``output_dtype="promote"``), which swap_norms reads from the module with its own weights.
    """
    entry, groups = setting
    original = hf_module(entry, groups)
    swapped, report = swap_norms(copy.deepcopy(original))
    assert isinstance(swapped, GatedRMSNorm), report.describe()
    assert [(s.path, s.original) for s in report.swapped] == [("", entry.name)]
    assert swapped.weight.dtype == torch.float32 and torch.equal(swapped.weight, original.weight)
    table = entry.spec_for(HIDDEN, EPS, groups)
    differences = []
    for dtype in DTYPES:
        x, z = inputs(dtype, seed=10 + DTYPES.index(dtype))
        with torch.no_grad():
            want, got = original(x, z), swapped(x, z)
        if got.dtype != want.dtype:
            differences.append(f"{dtype} input: HF returns {want.dtype}, swapped {got.dtype}")
        elif differing_rows(want, got):
            differences.append(f"{dtype} input: {differing_rows(want, got)} rows differ")
    wrong = {
        field: (value, table.to_dict()[field])
        for field, value in swapped.spec.to_dict().items()
        if value != table.to_dict()[field]
    }
    assert not differences and not wrong, (
        f"{_setting_id(setting)} with a float32 weight: {'; '.join(differences)}; "
        f"swap_norms' spec differs from the table's in (swapped, table): {wrong}"
    )
