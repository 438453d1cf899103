"""``backward="autograd"``: the norm as the op sequence eager model code runs, for autograd.

Autograd through these ops rounds the gradients where the eager program does (at the
before-scale cast, and in the half-precision products of the affine step), which is the
``"autograd"`` rounding model of `normkit.NormSpec` and `normkit.reference.normalize_vjp`.
For RMS with ``cast="before_scale"`` the ops are those of Hugging Face's ``LlamaRMSNorm``::

    h = x.to(float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    y = g * (h * torch.rsqrt(variance + eps)).to(x.dtype)

so its gradients are bit-identical to Llama's; LayerNorm centers first (``h - mean``, or the
fast variance ``mean(h^2) - mean^2`` clamped at 0), partial RMS reads ``h[:, :k]``, grouped
statistics read each group of the row as a row, eps outside
is ``1 / (sqrt(variance) + eps)``, DyT is ``tanh(alpha * h)``. The rows are not rescaled: rows
whose statistic overflows or underflows float32 give what the eager program gives.
"""

import torch

from normkit.torch._autograd import _acc_dtype
from normkit.torch._spec import RowSpec


def _normalized(
    h: torch.Tensor, spec: RowSpec, k: int, alpha: torch.Tensor | None
) -> torch.Tensor:
    """``y_hat`` of the rows ``h`` (in the compute dtype), the statistic from the first ``k``
    elements (the whole row for layer)."""
    if spec.kind == "dyt":
        assert alpha is not None
        return torch.tanh(alpha.to(h.dtype) * h)
    if spec.kind == "layer":
        mean = h.mean(-1, keepdim=True)
        centered = h - mean
        if spec.fast_variance:
            variance = torch.clamp_min(h.pow(2).mean(-1, keepdim=True) - mean.pow(2), 0.0)
        else:
            variance = centered.pow(2).mean(-1, keepdim=True)
    else:
        centered = h
        variance = (h if k == h.shape[-1] else h[:, :k]).pow(2).mean(-1, keepdim=True)
    # Not `_autograd._rstd` on rescaled rows: the eager program's own ops, for its bits.
    if spec.outside:
        return centered / (torch.sqrt(variance) + spec.eps)
    return centered * torch.rsqrt(variance + spec.eps)


def _scale(weight: torch.Tensor, spec: RowSpec, dtype: torch.dtype) -> torch.Tensor:
    """``scale_offset + w``: w itself without an offset; in w's dtype with
    ``offset_dtype="param"``; else in ``dtype`` promoted with w's."""
    if spec.scale_offset == 0:
        return weight
    if spec.offset_in_param:
        return weight + spec.scale_offset
    return weight.to(torch.promote_types(dtype, weight.dtype)) + spec.scale_offset


def norm_rows(
    values: torch.Tensor,
    spec: RowSpec,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: torch.Tensor | None,
    dtype: torch.dtype,
    out: torch.dtype,
) -> torch.Tensor:
    """``spec`` on rows ``values`` (rows, n) with the policy of inputs of ``dtype``, y in
    ``out``; ``weight``/``bias`` of shape (n,) in their own dtypes; the statistic per group of
    ``spec.group`` elements.

    With ``cast="before_scale"`` and a half ``dtype`` the affine step runs in the dtypes eager
    code has (``y_hat`` rounded to ``dtype``, times the scale in its own dtype); otherwise in
    the compute dtype.
    """
    acc = _acc_dtype(dtype)
    rows, n = values.shape
    group = spec.group
    # Each group of a row is normalized as a row; only whole-row kinds are grouped (k = group).
    groups = values.to(acc).reshape(rows * (n // group), group)
    y = _normalized(groups, spec, spec.k, alpha).reshape(rows, n)
    if dtype != acc and spec.before_scale:
        y = y.to(dtype)
        if weight is not None:
            y = _scale(weight, spec, torch.float32) * y
        if bias is not None:
            y = y + bias
    else:
        if weight is not None:
            y = y * _scale(weight, spec, acc).to(acc)
        if bias is not None:
            y = y + bias.to(acc)
    return y.to(out)


def add(
    x: torch.Tensor, residual: torch.Tensor, rounding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, h)``: ``h = x + residual`` as model code adds it (in x's dtype for
    ``rounding`` ``"rounded"``, else in the compute dtype), and the sum `norm_rows` reads."""
    if rounding == "rounded":
        h = x + residual
        return h, h
    acc = _acc_dtype(x.dtype)
    values = x.to(acc) + residual.to(acc)
    return values, values if rounding == "float32" else values.to(x.dtype)
