"""The model in PyTorch: an ``nn.Module`` trained with ``torch.optim.AdamW``, eager or under
``torch.compile`` (the model's forward; the loss, backward and optimizer step run eagerly, as in
most training loops); and the norms' share of an eager step from ``torch.profiler``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import normkit.torch as nk
from normkit import port
from normkit.bench.model.config import EPS, NORMKIT_NORMS, OWN_NORMS, PARTIAL_P, ModelConfig
from normkit.bench.model.data import Batches
from normkit.bench.model.weights import norms_file, read_matrices, read_norms, rope
from normkit.bridges import TorchBridge

COMPILER = "torch.compile"
NORM_SCOPE = "normkit.bench.model: norm"
devices = TorchBridge().devices

Factory = Callable[[int], nn.Module]
LAYERS: dict[str, tuple[str, Factory]] = {
    "own-layer": ("torch.nn.LayerNorm", lambda d: nn.LayerNorm(d, eps=EPS)),
    "own-rms": ("torch.nn.RMSNorm", lambda d: nn.RMSNorm(d, eps=EPS)),
    "layer": ("normkit.torch.LayerNorm", lambda d: nk.LayerNorm(d, eps=EPS)),
    "rms": ("normkit.torch.RMSNorm", lambda d: nk.RMSNorm(d, eps=EPS)),
    "partial-rms": (
        "normkit.torch.PartialRMSNorm", lambda d: nk.PartialRMSNorm(d, p=PARTIAL_P, eps=EPS)
    ),
    "dyt": ("normkit.torch.DyT", lambda d: nk.DyT(d)),
    "identity": ("torch.nn.Identity", lambda d: nn.Identity()),
}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout; ``x`` ``(batch, heads, seq, head_dim)``."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings, no biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.heads = config.heads
        self.query, self.key, self.value, self.out = (
            nn.Linear(d, d, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        q, k, v = (
            layer(x).view(batch, seq, self.heads, d // self.heads).transpose(1, 2)
            for layer in (self.query, self.key, self.value)
        )
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                           is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, d))


class MLP(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, ff = config.d_model, config.d_ff
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, norm: Factory) -> None:
        super().__init__()
        self.attention_norm, self.attention = norm(config.d_model), Attention(config)
        self.mlp_norm, self.mlp = norm(config.d_model), MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LanguageModel(nn.Module):
    """Embedding, blocks, final norm, untied head: token ids to next-token logits."""

    def __init__(self, config: ModelConfig, norm: Factory) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.d_model)
        self.blocks = nn.ModuleList(Block(config, norm) for _ in range(config.layers))
        self.norm = norm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        cos, sin = rope(config)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def implementation(norm: str) -> str:
    """The name of the norm layer the model uses for ``norm``."""
    return LAYERS[norm][0]


def build(config: ModelConfig, norm: str, folder: Path) -> LanguageModel:
    """The model with norm ``norm``, its weights those written in ``folder``: the matrices by
    path (``nn.Linear`` holds the transpose), the norms with `normkit.port`."""
    model = LanguageModel(config, LAYERS[norm][1])
    with torch.no_grad():
        for path, value in read_matrices(folder).items():
            weight = model.get_submodule(path).weight
            assert isinstance(weight, torch.Tensor)
            weight.copy_(torch.from_numpy(value if path == "embed" else value.T))
        if norm in OWN_NORMS:
            for path, params in read_norms(folder, norm, "torch").items():
                for name, value in params.items():
                    getattr(model.get_submodule(path), name).copy_(torch.from_numpy(value))
    if norm in NORMKIT_NORMS:
        port.import_norms(model, norms_file(folder, norm))
    return model


class Trainer:
    """Trains one model on the batches, one step per call, with AdamW (weight decay on the
    matrices only) and the config's schedule (``LambdaLR``)."""

    def __init__(self, config: ModelConfig, norm: str, compiled: bool, folder: Path,
                 data: Batches, device: str) -> None:
        self.model = build(config, norm, folder).to(device)
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            groups, lr=config.learning_rate, betas=config.betas, eps=config.adam_eps
        )
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: float(config.learning_rate_at(step)) / config.learning_rate
        )
        self.forward = torch.compile(self.model) if compiled else self.model
        self.inputs = torch.from_numpy(data.inputs).to(device)
        self.targets = torch.from_numpy(data.targets).to(device).long()
        self.weights = torch.from_numpy(np.broadcast_to(data.weights, data.inputs.shape[1:]).copy())
        self.weights = self.weights.to(device)

    def step(self, index: int) -> float:
        """One training step on batch ``index``; the loss before the update."""
        logits = self.forward(self.inputs[index])
        losses = F.cross_entropy(
            logits.flatten(0, 1), self.targets[index].flatten(), reduction="none"
        )
        loss = (losses * self.weights.flatten()).sum() / self.weights.sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.schedule.step()
        return float(loss.item())


def versions() -> dict[str, str]:
    return {"torch": torch.__version__, "threads": str(torch.get_num_threads())}


def device_kind(device: str) -> str:
    """What ``device`` is: the GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


@contextmanager
def _norms_scoped(model: nn.Module, norm: str) -> Iterator[None]:
    """Every norm layer's forward inside a profiler scope named `NORM_SCOPE`."""
    layer_type = type(LAYERS[norm][1](1))
    open_scopes: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        scope = torch.autograd.profiler.record_function(NORM_SCOPE)
        scope.__enter__()
        open_scopes.append(scope)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        open_scopes.pop().__exit__(None, None, None)

    handles = []
    for module in model.modules():
        if type(module) is layer_type:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profiled_norm_share(trainer: Trainer, norm: str, steps: list[int]) -> float:
    """The norms' share of the time ``torch.profiler`` records in an eager step, the median over
    ``steps`` (each profiled alone, so that one op the machine delayed moves one step's share
    only): the forward ops inside each norm layer (a profiler scope per call) and the backward
    nodes of those ops (matched by their autograd sequence numbers), over every top-level op of
    the step (forward, backward, optimizer). CPU time on the CPU, device time on CUDA."""
    return float(np.median([_profiled_share(trainer, norm, index) for index in steps]))


def _profiled_share(trainer: Trainer, norm: str, index: int) -> float:
    cuda = str(trainer.inputs.device).startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with _norms_scoped(trainer.model, norm), torch.profiler.profile(activities=activities) as prof:
        trainer.step(index)
    events = list(prof.events())

    def spent(event: Any) -> float:
        return float(event.device_time_total if cuda else event.cpu_time_total)

    scopes = [e for e in events if e.name == NORM_SCOPE]
    # An op that makes no autograd node shows the next op's sequence number: keep the numbers
    # only ops inside a norm show.
    inside = {c.sequence_nr for s in scopes for c in _descendants(s)}
    outside = {
        c.sequence_nr for e in events if e.cpu_parent is None and e.name != NORM_SCOPE
        and not e.name.startswith("autograd::") for c in (e, *_descendants(e))
    }
    sequence = inside - outside - {-1}
    backward = [
        e for e in events if e.cpu_parent is None and e.sequence_nr in sequence
        and e.name.startswith("autograd::engine::evaluate_function")
    ]
    top = [e for e in events if e.cpu_parent is None]
    total = sum(spent(e) for e in top)
    return (sum(spent(e) for e in scopes) + sum(spent(e) for e in backward)) / total


def _descendants(event: Any) -> Iterator[Any]:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)
