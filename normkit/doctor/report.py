"""What `normkit.doctor.examine` returns: one `TensorReport` per norm tensor, in a `Report`.

Plain data (numpy only), so a report can be printed, written as JSON and compared in tests.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeAlias

Verdict: TypeAlias = Literal[
    "fine",
    "offset_baked_in",
    "offset_doubled",
    "offset_missing",
    "eps_differs",
    "dtype_narrowed",
    "weights_differ",
    "unsure",
]
"""What is wrong with a norm tensor (or not):

- ``fine``: the runtime computes what the model means.
- ``offset_baked_in``: fine too: a Gemma-style ``1 + w`` whose 1 the converter added to the
  stored weights, for a runtime that multiplies by them as they are (llama.cpp).
- ``offset_doubled``: the runtime adds a 1 that the stored weights already hold (scale ``2 + w``).
- ``offset_missing``: the stored weights are ``w`` of a ``1 + w`` model and the runtime adds
  nothing (scale ``w``, near 0).
- ``eps_differs``: the runtime's eps is not the one the model's config (or the original) gives.
- ``dtype_narrowed``: the stored values lost precision: a narrower dtype than the config's or
  the original's, or rounded through one.
- ``weights_differ``: compared with the original, the weights are scaled or different (not an
  offset move).
- ``unsure``: the statistics of the weights fit neither reading; only ``--against`` can tell.
"""

FINDINGS: frozenset[str] = frozenset(
    {"offset_doubled", "offset_missing", "eps_differs", "dtype_narrowed", "weights_differ"}
)
"""The verdicts that are findings: `Report.findings` lists them, ``normkit doctor`` exits 1."""

Confidence: TypeAlias = Literal["exact", "high", "medium", "low"]
"""How sure a verdict is: ``exact`` (compared with the original, tensor by tensor, or read from
the file itself: a dtype, an eps), ``high``/``medium`` (from the weights' statistics, by the
rules in `normkit.doctor.verdicts`), ``low`` (the statistics do not decide)."""


@dataclass(frozen=True)
class Convention:
    """What a runtime computes with one stored norm tensor.

    ``scale_offset``: the runtime multiplies by ``scale_offset + stored`` (0 for a bias).
    ``model_offset``: the offset of the model's own definition (Hugging Face's class): 1 for
    Gemma's norms, also where a converter bakes it into the weights for a runtime without one.
    ``eps``: the runtime's eps for this norm (None where unknown), read from ``eps_from``.
    ``source``: where the convention comes from (a probed class, or a converter's rule, named).
    """

    runtime: str
    module: str
    scale_offset: float
    model_offset: float
    eps: float | None
    eps_from: str
    source: str


@dataclass(frozen=True)
class Stored:
    """A stored tensor: its dtype, shape and the statistics the verdicts read."""

    dtype: str
    shape: tuple[int, ...]
    median: float
    minimum: float
    maximum: float


@dataclass(frozen=True)
class Comparison:
    """A tensor against the original's: ``relation`` is ``"equal"``, a shift (``"+1"``,
    ``"-1"``, ...; the stored values are the original's plus it, rounded once), ``"scaled"``
    (``factor`` times the original's) or ``"different"``. ``expected`` is the relation a
    correct conversion gives (the original's offset minus the runtime's). ``rounded_in``: the
    dtype the shift was rounded in, when it is narrower than both tensors' dtypes."""

    original: str
    relation: str
    expected: str
    factor: float | None = None
    rounded_in: str | None = None
    original_eps: float | None = None


@dataclass(frozen=True)
class TensorReport:
    """One norm tensor: the runtime's `Convention`, the `Stored` values, the verdicts (first the
    offset's, then eps' and dtype's findings), how sure, and why."""

    name: str
    parameter: Literal["weight", "bias"]
    convention: Convention
    stored: Stored
    verdicts: tuple[Verdict, ...]
    confidence: Confidence
    reason: str
    comparison: Comparison | None = None

    @property
    def findings(self) -> tuple[Verdict, ...]:
        """The verdicts that are findings."""
        return tuple(v for v in self.verdicts if v in FINDINGS)


@dataclass(frozen=True)
class Report:
    """Everything `examine` found in a checkpoint.

    ``format``: ``"huggingface"``, ``"mlx-lm"``, ``"gguf"`` or ``"normkit"``. ``architecture``:
    the config's ``model_type`` or the GGUF's ``general.architecture``. ``tensors``: one entry
    per norm tensor, in the checkpoint's order. ``against``: the original's path, when compared
    with one. ``notes``: what could not be checked, and why.
    """

    path: str
    format: str
    architecture: str | None
    tensors: tuple[TensorReport, ...]
    against: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def findings(self) -> tuple[TensorReport, ...]:
        """The tensors with at least one finding."""
        return tuple(t for t in self.tensors if t.findings)

    @property
    def exact(self) -> bool:
        """Whether every finding is exact (so `normkit.doctor.fix` may correct it)."""
        return all(t.confidence == "exact" for t in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``findings`` added: the tensors' names)."""
        data = asdict(self)
        data["findings"] = [t.name for t in self.findings]
        return data

    def to_json(self) -> str:
        """`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def describe(self) -> str:
        """A table, one line per tensor (verdicts, confidence, runtime, convention, stored
        statistics), then the reasons for the findings and the notes."""
        lines = [f"{self.path}: {self.format}, {self.architecture or 'architecture unknown'}"
                 + (f", against {self.against}" if self.against else "")]
        width = max((len(t.name) for t in self.tensors), default=4)
        for t in self.tensors:
            c, s = t.convention, t.stored
            expects = f"{c.scale_offset:g} + w" if t.parameter == "weight" else "b"
            eps = "eps ?" if c.eps is None else f"eps {c.eps:.3g}"
            relation = f"  {t.comparison.relation} (expected {t.comparison.expected})" if (
                t.comparison) else ""
            lines.append(
                f"  {t.name:<{width}}  {','.join(t.verdicts):<16} {t.confidence:<6} "
                f"{c.module}: {expects}, {eps}; {s.dtype} median {s.median:.3g}{relation}"
            )
        findings = self.findings
        if findings:
            lines.append(f"{len(findings)} of {len(self.tensors)} norm tensors have findings:")
            lines += [f"  {t.name}: {t.reason}" for t in findings]
        else:
            lines.append(f"no finding in {len(self.tensors)} norm tensors")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)
