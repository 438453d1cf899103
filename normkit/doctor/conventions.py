"""What each runtime expects of a checkpoint's norm tensors, and what the model's config says.

- Hugging Face directories: transformers' classes, probed (`normkit.doctor.transformers_probe`).
- mlx-lm directories: mlx-lm's classes as its loader builds and fills them, probed
  (`normkit.doctor.mlx_probe`); the model's own offset and eps are transformers' for the same
  config, where transformers is installed.
- GGUF files: llama.cpp's rules, from its source (`normkit.doctor.llama_cpp`).
- normkit norms files: the `NormSpec` stored with each layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import import_module
from typing import Any

import numpy as np

from normkit.doctor import llama_cpp
from normkit.doctor.checkpoint import Checkpoint
from normkit.doctor.report import Convention
from normkit.spec import NormSpec

__all__ = ["Expected", "config_dtype", "expected"]

#: A float config or metadata value read as a dtype name.
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
           "float64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class Expected:
    """One norm tensor: the runtime's `Convention`, the eps the model's config gives it
    (``eps``; None where nothing says) and the dtype its values should keep (``dtype``)."""

    convention: Convention
    eps: float | None = None
    eps_source: str = ""
    dtype: str | None = None
    dtype_source: str = ""


def expected(checkpoint: Checkpoint) -> tuple[dict[str, Expected], list[str]]:
    """``({tensor name: Expected}, notes)`` for every norm tensor of ``checkpoint`` that a
    convention is known for; the notes say which norms are left unchecked, and why."""
    if checkpoint.format == "huggingface":
        return _huggingface(checkpoint)
    if checkpoint.format == "mlx-lm":
        return _mlx(checkpoint)
    if checkpoint.format == "gguf":
        return _gguf(checkpoint)
    return _normkit(checkpoint)


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The dtype a Hugging Face config declares (``dtype``, else ``torch_dtype``), or None."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str) and value in _DTYPES:
            return _DTYPES[value]
    return None


def _transformers_norms(checkpoint: Checkpoint) -> tuple[dict[str, tuple[str, NormSpec, str]],
                                                          list[str]]:
    """``{tensor name: (class, spec of the parameter, eps source)}`` of transformers' classes
    for the checkpoint's config, and notes for the norms left unprobed."""
    try:
        probe = import_module("normkit.doctor.transformers_probe")
    except ImportError as err:
        raise ImportError(
            f"{checkpoint.path}: probing transformers' norm classes needs torch and transformers: "
            f"pip install 'normkit[doctor]' ({err})"
        ) from err
    import transformers

    found: dict[str, tuple[str, NormSpec, str]] = {}
    notes = []
    for path, probed in probe.probe_directory(checkpoint.path).items():
        if probed.spec is None:
            notes.append(f"{path} ({probed.module}) is not checked: {probed.reason}")
            continue
        for param in ("weight", "bias"):
            found[f"{path}.{param}" if path else param] = (
                probed.module, probed.spec,
                f"transformers {transformers.__version__} {probed.module}, probed with "
                f"normkit.identify (eps from {probed.eps_from})",
            )
    return found, notes


def _huggingface(checkpoint: Checkpoint) -> tuple[dict[str, Expected], list[str]]:
    norms, notes = _transformers_norms(checkpoint)
    dtype = config_dtype(checkpoint.config)
    result = {}
    for name in checkpoint.names:
        if name not in norms:
            continue
        module, spec, source = norms[name]
        offset = _offset(spec, name)
        convention = Convention("transformers", module, offset, offset, spec.eps,
                                "config.json, as the module reads it", source)
        result[name] = Expected(convention, dtype=dtype, dtype_source="config.json dtype")
    notes += _unmatched(checkpoint, result)
    return result, notes


def _mlx(checkpoint: Checkpoint) -> tuple[dict[str, Expected], list[str]]:
    try:
        probe = import_module("normkit.doctor.mlx_probe")
    except ImportError as err:
        raise ImportError(
            f"{checkpoint.path}: an mlx-lm directory's conventions are probed with mlx-lm: "
            f"pip install 'normkit[mlx]' ({err})"
        ) from err
    notes: list[str] = []
    try:
        reference, unprobed = _transformers_norms(checkpoint)
    except (ImportError, ValueError) as err:
        reference = {}
        notes.append(f"the model's own offsets and eps are not checked (transformers' classes "
                     f"could not be probed: {err})")
    else:
        notes += [f"transformers: {note}" for note in unprobed]
    dtype = config_dtype(checkpoint.config)
    result = {}
    for name, norm in probe.probe_mlx_directory(checkpoint.path).items():
        if name not in checkpoint.names:
            continue
        if norm.spec is None:
            notes.append(f"{name} ({norm.module}) is not checked: {norm.reason}")
            continue
        stored = checkpoint.tensor(name).astype(np.float64)
        added = _added(norm.loaded.astype(np.float64) - stored)
        if added is None:
            notes.append(f"{name}: mlx-lm's loader changes it by more than a constant "
                         "(its sanitize), so it is not checked")
            continue
        offset = _offset(norm.spec, name) + added
        source = f"mlx-lm {_version('mlx_lm')} {norm.module}, probed with normkit.identify"
        if added:
            source += f"; its loader (Model.sanitize) adds {added:g} to the stored values"
        model = reference.get(name)
        convention = Convention(
            "mlx-lm", norm.module, offset, offset if model is None else _offset(model[1], name),
            norm.spec.eps, "config.json, as mlx-lm's module reads it", source,
        )
        eps, eps_source = (None, "") if model is None else (model[1].eps, model[2])
        result[name] = Expected(convention, eps, eps_source, dtype, "config.json dtype")
    notes += _unmatched(checkpoint, result)
    return result, notes


def _gguf(checkpoint: Checkpoint) -> tuple[dict[str, Expected], list[str]]:
    metadata = checkpoint.config
    arch = checkpoint.architecture
    found = llama_cpp.eps_key(metadata)
    notes = [] if found else ["the metadata holds no norm eps; eps is not checked"]
    key, eps = found if found else ("", None)
    result = {}
    for name in checkpoint.names:
        if not name.endswith(("norm.weight", "norm.bias")):
            continue
        weight = name.endswith(".weight")
        rule = llama_cpp.baked_offset(arch, name) if weight else None
        source = llama_cpp.RUNTIME_SOURCE + (f"; {rule.source}" if rule else "")
        convention = Convention(
            llama_cpp.RUNTIME, arch or "?", 0.0, rule.offset if rule else 0.0, eps,
            f"metadata {key}" if key else "unknown", source,
        )
        result[name] = Expected(convention, dtype=llama_cpp.NORM_DTYPE,
                                dtype_source=llama_cpp.NORM_DTYPE_SOURCE)
    return result, notes


def _normkit(checkpoint: Checkpoint) -> tuple[dict[str, Expected], list[str]]:
    result = {}
    for name, spec in checkpoint.specs.items():
        offset = _offset(spec, name)
        convention = Convention(
            "normkit", f"NormSpec(kind={spec.kind!r})", offset, offset, spec.eps,
            "the file's spec", "the NormSpec stored with the layer",
        )
        result[name] = Expected(convention)
    return result, []


def _offset(spec: NormSpec, name: str) -> float:
    return spec.scale_offset if name.endswith("weight") else 0.0


def _added(difference: np.ndarray) -> float | None:
    """The constant the loader added (0 when none), or None when it is not a constant."""
    if difference.size == 0:
        return 0.0
    value = float(np.median(difference))
    if not np.all(np.abs(difference - value) <= 1e-6 * max(1.0, abs(value))):
        return None
    return 0.0 if math.isclose(value, 0.0, abs_tol=1e-6) else value


def _unmatched(checkpoint: Checkpoint, known: Mapping[str, Expected]) -> list[str]:
    """A note naming the tensors called ``*norm*`` that no probed module claims."""
    names = [n for n in checkpoint.names if "norm" in n.lower() and n not in known]
    if not names:
        return []
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return [f"{len(names)} tensor(s) named like norms match no probed norm module and are not "
            f"checked: {shown}"]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return "?"
