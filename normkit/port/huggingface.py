"""Swap a torch model's norm layers for normkit's, each one recognised by probing it.

Made for Hugging Face transformers models, whose norms are about two hundred classes with a few
conventions between them (cast order, offset, bias, eps), but nothing here imports
transformers: any ``torch.nn.Module`` works, and a model's ``config`` is read for eps values
only. How a layer is recognised (see `swap_norms`):

1. Candidates: every leaf module (no children) whose class name contains ``norm`` (any case),
   or that is a ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm``, and is not already normkit's.
2. A candidate whose ``forward`` takes more than the input (or, for a gated norm, the input and
   a ``gate``), that has parameters other than ``weight`` and ``bias``, or whose normalized
   shape is unknown is left alone.
3. A copy of it is probed with `normkit.identify` (a gated one with `identify_gated`; weights
   set by the probe, in float32, bfloat16 and float16, on inputs of shape
   ``(1, rows, *normalized_shape)``): kind, eps and its placement, scale, offset, bias and cast
   order, and the gate's position and activation and the groups of the statistic.
4. eps is taken from the module (`EPS_ATTRIBUTES`), else from the config (any key containing
   ``eps``), else the measured value, whichever comes first that agrees with the measurement
   within `EPS_AGREEMENT` and reproduces the module's float32 outputs within normkit's float32
   bound (`normkit.tolerances`) at rows around the eps transition.
5. The module becomes ``normkit.torch.from_spec(spec, shape, kernel="composite")`` with its
   parameters copied (a gated RMS norm: `normkit.torch.GatedRMSNorm`, called as
   ``module(x, gate)``), when the spec is a norm's (not DyT's) and every field of it is pinned;
   otherwise it stays, and the report says why. The composite path runs the op sequence of
   Hugging Face's RMS norms (float32 statistic, ``y_hat`` rounded from float32), so their
   half-precision outputs are bit-identical; the CPU kernel, which rounds ``y_hat`` from an
   exact statistic, is within normkit's tolerances but not bit-identical (``kernel=``).
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from normkit import reference, tolerances
from normkit.backends import bridge
from normkit.identify import Identification, identify, identify_gated
from normkit.spec import NormSpec
from normkit.torch.kernels import Kernel, check_kernel
from normkit.torch.modules import GatedRMSNorm, LayerNorm, PartialRMSNorm, RMSNorm, from_spec

__all__ = [
    "EPS_AGREEMENT",
    "EPS_ATTRIBUTES",
    "PROBE_DTYPES",
    "LeftAlone",
    "Swap",
    "SwapReport",
    "swap_norms",
]

#: Where a module keeps its eps, in the order they are read (torch: ``eps``; Hugging Face:
#: ``variance_epsilon`` or ``eps``). ``eps = None`` is torch ``RMSNorm``'s: float32's machine eps.
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon")
#: The largest relative difference between a stored eps and the one `identify` measures.
EPS_AGREEMENT = 0.01
#: The input dtypes a candidate is probed in; the parameters take the input's dtype.
PROBE_DTYPES = ("float32", "bfloat16", "float16")

_NORMKIT = (RMSNorm, GatedRMSNorm, PartialRMSNorm, LayerNorm)
_PARAMETERS = ("weight", "bias")
_KINDS = ("rms", "partial_rms", "layer")
_SEED = 0
_CONFIRM_ROWS = 4  # rows per size in the float32 check of eps

ProbeFn = Callable[..., torch.Tensor]
"""``fn(x, scale, bias)``, or ``fn(x, gate, scale, bias)`` for a gated norm."""


@dataclass(frozen=True)
class Swap:
    """One replaced module: its path, its class name, the spec it follows and where eps came from
    (``"module.<attribute>"``, ``"config.<key>"``, ``"torch eps=None"`` or ``"measured"``)."""

    path: str
    original: str
    spec: NormSpec
    eps_from: str


@dataclass(frozen=True)
class LeftAlone:
    """A candidate module that was not replaced, and why."""

    path: str
    original: str
    reason: str


@dataclass(frozen=True)
class SwapReport:
    """What `swap_norms` replaced and what it left alone, in ``named_modules`` order."""

    swapped: tuple[Swap, ...]
    left_alone: tuple[LeftAlone, ...]

    @property
    def swapped_classes(self) -> frozenset[str]:
        """The class names of the replaced modules."""
        return frozenset(s.original for s in self.swapped)

    @property
    def left_alone_classes(self) -> dict[str, str]:
        """Each left-alone class name with the reason for its first instance."""
        reasons: dict[str, str] = {}
        for entry in self.left_alone:
            reasons.setdefault(entry.original, entry.reason)
        return reasons

    def describe(self) -> str:
        """One line per class: how many were swapped and as what, or left alone and why."""
        lines = []
        for name in sorted(self.swapped_classes):
            swaps = [s for s in self.swapped if s.original == name]
            specs = sorted({repr(s.spec) for s in swaps})
            lines.append(f"{name}: {len(swaps)} swapped as {'; '.join(specs)}")
        for name, reason in sorted(self.left_alone_classes.items()):
            count = sum(entry.original == name for entry in self.left_alone)
            lines.append(f"{name}: {count} left alone: {reason}")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Recognised:
    spec: NormSpec
    shape: tuple[int, ...]
    eps_from: str


def swap_norms(
    module: nn.Module, *, config: object | None = None, kernel: Kernel = "composite"
) -> tuple[nn.Module, SwapReport]:
    """Replace the norm layers of ``module`` by normkit modules computing the same function.

    Each candidate (see the module docstring) is probed once per class and configuration; when
    its spec is pinned it is replaced in place by ``normkit.torch.from_spec(spec, shape)`` with
    its ``weight`` and ``bias`` copied (same dtype, device and ``requires_grad``) and the same
    training mode. Everything else is left as it is and listed, with the reason, in the report.

    Args:
      module: the model (a ``module`` that is itself a norm is returned replaced).
      config: read for eps values (every key containing ``eps``, nested configs included).
        Default: ``module.config`` if there is one (a Hugging Face ``PreTrainedModel``).
      kernel: the replacements' ``kernel``. Default ``"composite"``: Hugging Face's RMS norms
        (Llama, Qwen, Mistral, Gemma, T5, ...) bit for bit in bfloat16 and float16, as they
        round ``y_hat`` from a float32 statistic. ``"auto"`` (on the CPU, normkit's CPU kernel:
        faster, and closer to the exact reference) is within normkit's tolerances, not
        bit-identical: about one half-precision row in a few thousand rounds the other way.

    Returns ``(module, report)``.
    """
    if config is None:
        config = getattr(module, "config", None)
    check_kernel(kernel)
    config_eps = dict(_config_eps(config))
    outcomes: dict[Hashable, _Recognised | str] = {}
    replaced: dict[int, nn.Module] = {}
    swapped: list[Swap] = []
    left_alone: list[LeftAlone] = []
    root = module
    for path, child in list(module.named_modules(remove_duplicate=False)):
        if not _is_candidate(child):
            continue
        name = type(child).__name__
        key = _configuration(child)
        if key not in outcomes:
            with warnings.catch_warnings():  # the probes' own inputs (half x, float32 w) warn
                warnings.simplefilter("ignore")
                outcomes[key] = _recognise(child, config_eps)
        outcome = outcomes[key]
        if isinstance(outcome, str):
            left_alone.append(LeftAlone(path, name, outcome))
            continue
        if id(child) not in replaced:
            replaced[id(child)] = _replacement(child, outcome.spec, outcome.shape, kernel)
        new = replaced[id(child)]
        if path:
            parent, _, attribute = path.rpartition(".")
            setattr(module.get_submodule(parent), attribute, new)
        else:
            root = new
        swapped.append(Swap(path, name, outcome.spec, outcome.eps_from))
    return root, SwapReport(tuple(swapped), tuple(left_alone))


def _is_candidate(module: nn.Module) -> bool:
    if isinstance(module, _NORMKIT) or next(module.children(), None) is not None:
        return False
    named = "norm" in type(module).__name__.lower()
    return named or isinstance(module, (nn.LayerNorm, nn.RMSNorm))


def _configuration(module: nn.Module) -> Hashable:
    """What decides a module's function besides its parameter values: its class, its simple
    attributes (eps, flags, sizes), its parameters' and buffers' shapes, dtypes and devices."""
    attributes = tuple(
        (name, value)
        for name, value in sorted(vars(module).items())
        if not name.startswith("_")
        and name != "training"
        and isinstance(value, (bool, int, float, str, tuple, type(None)))
    )
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.device)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    )
    key = (type(module), attributes, tensors)
    try:
        hash(key)
    except TypeError:  # an attribute tuple holding something unhashable: probe this one alone
        return (type(module), id(module))
    return key


def _recognise(module: nn.Module, config_eps: Mapping[str, float]) -> _Recognised | str:
    """The spec ``module`` follows and its shape, or the reason it cannot be swapped."""
    signature = inspect.signature(module.forward)
    inputs = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind not in positional for p in inputs) or len(inputs) not in (1, 2):
        return f"its forward{signature} takes more than the input"
    gated = len(inputs) == 2
    if gated and inputs[1].name != "gate":
        return f"its forward{signature} takes more than the input (and not a gate)"
    names = [name for name, _ in module.named_parameters()]
    others = [name for name in names if name not in _PARAMETERS]
    if others:
        return f"it has parameters other than weight and bias: {others}"
    shape = _normalized_shape(module)
    if isinstance(shape, str):
        return shape
    probe, seen = _probe_fn(module, gated)
    device = _device(module)
    try:
        found = (identify_gated if gated else identify)(
            probe, shape, backend="torch", params=True, device=device, dtypes=PROBE_DTYPES
        )
    except Exception as exc:  # foreign code: any failure means "not recognised"
        return f"identify: {type(exc).__name__}: {exc}"
    promoted = sorted({f"{y} for {x} inputs" for x, y in seen if x != y})
    if promoted:
        return f"it returns {', '.join(promoted)} with parameters in the input's dtype"
    output_dtype = _output_dtype(module, shape, gated)
    if output_dtype not in ("input", "promote"):
        return output_dtype
    spec = found.spec.replace(output_dtype=output_dtype)
    if spec.kind not in _KINDS:
        return (
            f"identify finds kind={spec.kind!r} (alpha {spec.alpha_init:g}): swap_norms replaces "
            "RMSNorm, partial RMSNorm and LayerNorm only"
        )
    if spec.gate is not None and spec.kind != "rms":
        return (
            f"identify finds a gated kind={spec.kind!r}: a gated norm called as module(x, gate) "
            "is replaced by GatedRMSNorm, an RMSNorm"
        )
    unpinned = _unpinned(found)
    if unpinned:
        why = [note for note in found.notes if any(field in note for field in unpinned)]
        return f"identify could not determine {', '.join(unpinned)}: {'; '.join(why)}"
    has = {name: name in names for name in _PARAMETERS}
    if (spec.scale, spec.bias) != (has["weight"], has["bias"]):
        return (
            f"identify finds scale={spec.scale}, bias={spec.bias}, but its parameters are "
            f"{names or 'none'}"
        )
    spec = spec.replace(axis=tuple(range(-len(shape), 0)))
    chosen = _eps(module, spec, shape, probe, device, config_eps)
    if isinstance(chosen, str):
        return chosen
    source, eps = chosen
    return _Recognised(spec.replace(eps=eps), shape, source)


def _unpinned(found: Identification) -> list[str]:
    """The fields identify left open that change the forward (cast: only with a scale or bias).

    ``backward``, which a forward probe never sees, is not one: the replacement keeps the
    spec's exact backward."""
    spec = found.spec
    return [
        name
        for name in found.undetermined
        if name != "backward" and not (name == "cast" and not spec.scale and not spec.bias)
    ]


def _normalized_shape(module: nn.Module) -> tuple[int, ...] | str:
    shapes = {tuple(p.shape) for name, p in module.named_parameters() if name in _PARAMETERS}
    if len(shapes) > 1:
        return f"its weight and bias have different shapes: {sorted(shapes)}"
    if shapes:
        return shapes.pop()
    declared = getattr(module, "normalized_shape", None)
    if isinstance(declared, int):
        return (declared,)
    if isinstance(declared, (tuple, list, torch.Size)) and all(
        isinstance(d, int) for d in declared
    ):
        return tuple(declared)
    return "it has no weight, bias or normalized_shape, so its normalized size is unknown"


def _probe_fn(module: nn.Module, gated: bool) -> tuple[ProbeFn, set[tuple[str, str]]]:
    """A copy of ``module`` as ``fn(x, scale, bias)`` for `identify` (gated:
    ``fn(x, gate, scale, bias)`` for `identify_gated`): the parameters take the input's dtype
    and the values passed; ``x`` of shape ``(rows, *shape)`` is called as one sequence
    ``(1, rows, *shape)``. The set collects the (input, output) dtype names seen."""
    probe = copy.deepcopy(module).eval().requires_grad_(False)
    seen: set[tuple[str, str]] = set()

    def fn(x: torch.Tensor, *rest: torch.Tensor | None) -> torch.Tensor:
        gate, (scale, bias) = (rest[0], rest[1:]) if gated else (None, rest)
        probe.to(x.dtype)
        for name, value in (("weight", scale), ("bias", bias)):
            parameter = getattr(probe, name, None)
            if value is not None and isinstance(parameter, nn.Parameter):
                parameter.copy_(value)
        assert gate is not None or not gated
        y = probe(x.unsqueeze(0)) if gate is None else probe(x.unsqueeze(0), gate.unsqueeze(0))
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"the module returned {type(y).__name__}, not a tensor")
        seen.add((_dtype_name(x), _dtype_name(y)))
        return y.squeeze(0)

    return fn, seen


def _output_dtype(module: nn.Module, shape: tuple[int, ...], gated: bool) -> str:
    """``"input"`` or ``"promote"``: the output dtype half inputs get with the module's own
    parameters (float32 master weights promote, in Hugging Face's Llama and Mamba2 norms), or
    the reason it is neither. Half parameters (a model held in one dtype) cannot tell them
    apart: "input"."""
    probe = copy.deepcopy(module).eval().requires_grad_(False)
    own = [p.dtype for p in probe.parameters()]
    if not own or any(not d.is_floating_point or d.itemsize < 4 for d in own):
        return "input"  # parameters in a half dtype: a model held in one dtype
    found = set()
    for half in (torch.bfloat16, torch.float16):
        promoted = half
        for dtype in own:
            promoted = torch.promote_types(promoted, dtype)
        if promoted == half:
            continue
        x = torch.ones((1, 2, *shape), dtype=half, device=_device(module))
        y = probe(x, x) if gated else probe(x)
        if y.dtype not in (half, promoted):
            return (
                f"it returns {_dtype_name(y)} for {_dtype_name(x)} inputs with parameters in "
                f"{', '.join(sorted({str(d).removeprefix('torch.') for d in own}))}"
            )
        found.add("input" if y.dtype == half else "promote")
    if len(found) > 1:
        return "its output dtype follows neither the input nor the promoted dtype throughout"
    return found.pop() if found else "input"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _device(module: nn.Module) -> str:
    tensor = next(iter([*module.parameters(), *module.buffers()]), None)
    return "cpu" if tensor is None else str(tensor.device)


def _eps(
    module: nn.Module,
    spec: NormSpec,
    shape: tuple[int, ...],
    probe: ProbeFn,
    device: str,
    config_eps: Mapping[str, float],
) -> tuple[str, float] | str:
    """The first eps that agrees with the measured one and reproduces the module's outputs."""
    measured = spec.eps
    assert measured is not None  # identify pinned it
    candidates = [*_module_eps(module), *((f"config.{k}", v) for k, v in config_eps.items())]
    candidates.append(("measured", measured))
    tried = []
    for source, value in candidates:
        if abs(value - measured) > EPS_AGREEMENT * measured:
            tried.append(f"{source} = {value:g} (measured {measured:g})")
            continue
        error = _confirm(probe, spec.replace(eps=value), shape, device)
        if error.passed:
            return source, value
        tried.append(
            f"{source} = {value:g} (error {error.error:.2g} {error.bound.unit}, "
            f"bound {error.bound.value:g})"
        )
    return "no eps reproduces its float32 outputs: " + "; ".join(tried)


def _module_eps(module: nn.Module) -> Iterator[tuple[str, float]]:
    for name in EPS_ATTRIBUTES:
        if not hasattr(module, name):
            continue
        value = getattr(module, name)
        if value is None and name == "eps":
            yield "torch eps=None", torch.finfo(torch.float32).eps
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            yield f"module.{name}", float(value)


def _config_eps(config: object | None) -> Iterator[tuple[str, float]]:
    """Every positive float in ``config`` (nested configs included) under a key with ``eps``."""
    if config is None:
        return
    to_dict = getattr(config, "to_dict", None)
    values: object = to_dict() if callable(to_dict) else vars(config)
    yield from _eps_items(values, "")


def _eps_items(values: object, prefix: str) -> Iterator[tuple[str, float]]:
    if not isinstance(values, Mapping):
        return
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _eps_items(value, name + ".")
        elif "eps" in str(key) and isinstance(value, float) and value > 0:
            yield name, value


def _confirm(
    probe: ProbeFn, spec: NormSpec, shape: tuple[int, ...], device: str
) -> tolerances.Measurement:
    """The module's float32 output against the reference for ``spec``, on rows of unit size and
    around the eps transition (where eps shows), with random weight and bias."""
    rng = np.random.default_rng(_SEED)
    assert spec.eps is not None
    transition = math.sqrt(spec.eps) if spec.eps_placement == "inside" else spec.eps
    sizes = np.repeat([1.0, 0.5 * transition, 2.0 * transition], _CONFIRM_ROWS)
    trailing = (1,) * len(shape)
    size = sizes.reshape(-1, *trailing)
    mean = rng.normal(size=(len(sizes), *trailing))
    x = (size * (rng.normal(size=(len(sizes), *shape)) + mean)).astype(np.float32)
    w = (spec.scale_init + 0.5 * rng.normal(size=shape)).astype(np.float32) if spec.scale else None
    b = (0.5 * rng.normal(size=shape)).astype(np.float32) if spec.bias else None
    if spec.gate is None:
        y = bridge("torch").forward(probe, x, w, b, device)
        expected = reference.normalize(x.astype(np.float64), spec, w, b)
        return tolerances.measure(y, expected, "float32")
    z = (2 * rng.normal(size=x.shape)).astype(np.float32)

    def stacked(xz: torch.Tensor, scale: Any, bias: Any) -> torch.Tensor:
        return probe(xz[0], xz[1], scale, bias)

    y = bridge("torch").forward(stacked, np.stack([x, z]), w, b, device)
    expected = reference.gated_normalize(x.astype(np.float64), z, spec, w, b)
    return tolerances.measure(y, expected, "float32")


def _replacement(
    old: nn.Module, spec: NormSpec, shape: tuple[int, ...], kernel: Kernel
) -> nn.Module:
    """``from_spec(spec, shape, kernel=kernel)`` with ``old``'s parameters (values, dtype,
    device, grad flag)."""
    sources = {name: getattr(old, name, None) for name in _PARAMETERS}
    like = next((p for p in sources.values() if isinstance(p, torch.Tensor)), None)
    factory: dict[str, Any] = {} if like is None else {"device": like.device, "dtype": like.dtype}
    new = from_spec(spec, shape, kernel=kernel, **factory)
    with torch.no_grad():
        for name, source in sources.items():
            if isinstance(source, torch.Tensor):
                target = getattr(new, name)
                target.copy_(source)
                target.requires_grad_(source.requires_grad)
    return new.train(old.training)
