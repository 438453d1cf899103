"""`examine`: read a checkpoint, find each norm tensor's convention, and judge it."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Literal

import numpy as np

from normkit.doctor import conventions
from normkit.doctor.checkpoint import Checkpoint
from normkit.doctor.counterparts import counterparts
from normkit.doctor.read import read_checkpoint
from normkit.doctor.report import (
    FINDINGS,
    Comparison,
    Convention,
    Report,
    Stored,
    TensorReport,
    Verdict,
)
from normkit.doctor.verdicts import (
    Reading,
    compare,
    eps_differs,
    lost_precision,
    narrower,
    offset_verdict,
    ordered,
    read_statistics,
    settle_groups,
)

__all__ = ["examine"]


def examine(path: str | os.PathLike[str], against: str | os.PathLike[str] | None = None,
            ) -> Report:
    """Judge every norm tensor of the checkpoint at ``path`` against what its runtime expects.

    ``path``: a Hugging Face or mlx-lm model directory (``config.json`` and safetensors), a GGUF
    file or a normkit norms file. ``against``: the original checkpoint it was converted from
    (any of those formats); each tensor is then compared with the original's, exactly.
    Without it the verdicts come from the weights' statistics (see `normkit.doctor.verdicts`).

    Returns a `Report`: ``report.findings`` lists the tensors with a finding. Raises ValueError
    for a path that is no checkpoint (a pickle-only directory included: nothing is unpickled)
    and ImportError naming the extra a format needs.
    """
    checkpoint = read_checkpoint(path)
    expected, notes = conventions.expected(checkpoint)
    if not expected:
        notes.append("no norm tensor with a known convention was found")
    originals: dict[str, tuple[Checkpoint, str, conventions.Expected]] = {}
    if against is not None:
        original = read_checkpoint(against)
        original_expected, original_notes = conventions.expected(original)
        notes += [f"original: {note}" for note in original_notes]
        for name, source in counterparts(checkpoint, original, expected).items():
            if source in original_expected:
                originals[name] = (original, source, original_expected[source])
        alone = [name for name in expected if name not in originals]
        if alone:
            notes.append(
                f"{len(alone)} norm tensor(s) have no counterpart in the original and are read "
                f"from their statistics: {', '.join(alone[:3])}{', ...' if len(alone) > 3 else ''}"
            )
    model_has_offset = any(e.convention.model_offset for e in expected.values())
    stored = {name: checkpoint.tensor(name) for name in expected}
    readings: dict[str, Reading] = {}
    comparisons: dict[str, Comparison] = {}
    for name, exp in expected.items():
        parameter = "bias" if name.endswith("bias") else "weight"
        if name in originals:
            original, source, original_exp = originals[name]
            shift = (original_exp.convention.scale_offset - exp.convention.scale_offset
                     if parameter == "weight" else 0.0)
            try:
                comparison = compare(stored[name], original.tensor(source), source, shift,
                                     scale=parameter == "weight")
            except ValueError as err:
                notes.append(f"{name}: not compared with the original: {err}")
            else:
                comparisons[name] = replace(comparison, original_eps=original_exp.convention.eps)
                readings[name] = offset_verdict(comparison, parameter)
                continue
        readings[name] = read_statistics(stored[name], exp.convention, parameter,
                                         model_has_offset)
    statistical = {n: r for n, r in readings.items() if n not in comparisons}
    groups = {n: _group(expected[n].convention) for n in statistical}
    readings.update(settle_groups(statistical, groups))
    tensors = tuple(
        _tensor_report(name, expected[name], stored[name], readings[name],
                       comparisons.get(name), originals.get(name))
        for name in checkpoint.names if name in expected
    )
    return Report(str(path), checkpoint.format, checkpoint.architecture, tensors,
                  None if against is None else str(against), tuple(notes))


def _group(convention: Convention) -> str:
    """The tensors a conversion bug moves together: one class (GGUF: one architecture) and
    one pair of offsets."""
    offsets = f"{convention.scale_offset:g} + w, model {convention.model_offset:g} + w"
    return f"{convention.module} ({offsets})"


def _tensor_report(
    name: str,
    exp: conventions.Expected,
    values: np.ndarray,
    reading: Reading,
    comparison: Comparison | None,
    original: tuple[Checkpoint, str, conventions.Expected] | None,
) -> TensorReport:
    """The tensor's verdicts: the offset's reading, then eps and dtype findings."""
    verdicts: list[Verdict] = [reading.verdict]
    reasons = [reading.reason]
    convention = exp.convention
    if comparison is not None and original is not None:
        reference_eps, eps_source = original[2].convention.eps, "the original's"
    else:
        reference_eps, eps_source = exp.eps, exp.eps_source
    if eps_differs(convention.eps, reference_eps):
        verdicts.append("eps_differs")
        reasons.append(f"the runtime's eps is {convention.eps:.6g} (from {convention.eps_from}), "
                       f"{eps_source} is {reference_eps:.6g}")
    if comparison is not None and original is not None:
        source_values = original[0].tensor(original[1])
        shift = 0.0 if comparison.relation in ("scaled", "different", "equal") else float(
            comparison.relation)
        narrowed = comparison.rounded_in is not None or (
            narrower(values.dtype, source_values.dtype)
            and lost_precision(values, source_values, shift)
        )
        if narrowed:
            verdicts.append("dtype_narrowed")
            via = comparison.rounded_in or values.dtype.name
            reasons.append(f"stored as {values.dtype.name}, rounded in {via} from the original's "
                           f"{source_values.dtype.name}")
    elif narrower(values.dtype, exp.dtype):
        verdicts.append("dtype_narrowed")
        reasons.append(f"stored as {values.dtype.name}, narrower than {exp.dtype} "
                       f"({exp.dtype_source})")
    if any(v in FINDINGS for v in verdicts):
        verdicts = [v for v in verdicts if v != "fine"]
    flat = values.astype(np.float64).ravel()
    stored = Stored(values.dtype.name, tuple(values.shape), float(np.median(flat)),
                    float(flat.min()), float(flat.max()))
    parameter: Literal["weight", "bias"] = "bias" if name.endswith("bias") else "weight"
    return TensorReport(name, parameter, convention, stored, ordered(verdicts),
                        reading.confidence, "; ".join(reasons), comparison)
