"""The outcome of one conformance case on one device, as the worker reports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from normkit.conformance.cases import Case


@dataclass
class Result:
    """The outcome of one case on one device: PASS, FAIL or SKIP, with figures or the reason."""

    target: str
    device: str
    case: Case
    status: str
    reason: str = ""
    measurements: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def worst(self) -> float:
        """The largest error as a fraction of its bound (above 1 fails); 0 without figures."""
        return max(
            (m["error"] / m["bound"]["value"] for m in self.measurements.values()), default=0.0
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "device": self.device,
            "case_id": self.case.id,
            "case": self.case.label,
            "features": list(self.case.features),
            **self.case.to_dict(),
            "status": self.status,
            "reason": self.reason,
            "worst_fraction_of_bound": self.worst,
            "measurements": self.measurements,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        return cls(
            data["target"],
            data["device"],
            Case.from_dict(data),
            data["status"],
            data["reason"],
            data["measurements"],
        )
