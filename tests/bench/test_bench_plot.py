"""normkit.bench.plot and compare: the ratios it draws (a column per timing), its caption, the files
it writes, its error without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from normkit.bench import compare, plot
from normkit.bench.core import FIELDS, MEMORY_NOTE


def row(
    implementation: str, role: str, hidden: int, median_s: float, **fields: Any
) -> dict[str, Any]:
    base: dict[str, Any] = dict.fromkeys(FIELDS)
    base.update(implementation=implementation, role=role, backend="torch", device="cpu",
                mode="eager", timing="latency", memory="as allocated", dtype="float32",
                shape=[4096, hidden], median_s=median_s, gb_per_s=1.0 / median_s, ratios={})
    base["pass"] = "forward"
    base.update(fields)
    return base


def group(hidden: int, times: dict[str, float], **fields: Any) -> list[dict[str, Any]]:
    """One group's rows with their ratios as the bench computes them (other / this)."""
    rows = []
    for name, median in times.items():
        if name.startswith("copy"):
            rows.append(row(name, "copy floor", hidden, median, **fields))
            continue
        role = "normkit" if name.startswith("normkit.") else "peer"
        others = {o: t / median for o, t in times.items() if o != name and not o.startswith("copy")}
        rows.append(row(name, role, hidden, median, ratios=others, **fields))
    return rows


TIMES = {"normkit.torch.RMSNorm": 1.0, "torch.nn.RMSNorm": 2.0, "normkit.torch.LayerNorm": 1.0,
         "torch.nn.LayerNorm": 0.5, "copy (clone)": 0.8}
ROWS = [*group(4096, TIMES), *group(1024, {**TIMES, "torch.nn.RMSNorm": 3.0}),
        *group(1024, TIMES, dtype="bfloat16"),
        *group(1024, {**TIMES, "torch.nn.RMSNorm": 1.5}, memory="on huge pages"),
        *group(1024, {**TIMES, "torch.nn.RMSNorm": 1.25}, timing="throughput")]


@pytest.mark.parametrize(("name", "kind"), [
    ("normkit.torch.RMSNorm", "rms"), ("keras.layers.RMSNormalization", "rms"),
    ("Llama RMSNorm (torch ops)", "rms"),
    ("normkit.torch.PartialRMSNorm(p=0.0625)", "partial_rms"),
    ("keras.layers.LayerNormalization", "layer"), ("flax.linen.LayerNorm", "layer"),
    ("copy (clone)", None),
])
def test_kind_from_the_name(name: str, kind: str | None) -> None:
    assert compare.norm_kind(name) == kind


def test_ratios_pair_layers_of_one_kind_in_order_of_hidden_size() -> None:
    table = compare.ratios(ROWS)
    def comparison(normkit: str, peer: str, memory: str = "as allocated") -> compare.Comparison:
        return compare.Comparison("torch", "cpu", normkit, peer, "eager", memory)

    rms = comparison("normkit.torch.RMSNorm", "torch.nn.RMSNorm")
    layer = comparison("normkit.torch.LayerNorm", "torch.nn.LayerNorm")
    rms_huge = comparison("normkit.torch.RMSNorm", "torch.nn.RMSNorm", "on huge pages")
    layer_huge = comparison("normkit.torch.LayerNorm", "torch.nn.LayerNorm", "on huge pages")
    assert set(table) == {rms, layer, rms_huge, layer_huge}
    assert table[rms] == {("float32", "forward", "latency"): [3.0, 2.0],
                          ("bfloat16", "forward", "latency"): [2.0],
                          ("float32", "forward", "throughput"): [1.25]}  # timings kept apart
    assert table[rms_huge] == {("float32", "forward", "latency"): [1.5]}  # and the views
    assert table[layer][("float32", "forward", "latency")] == [0.5, 0.5]


def test_labels_tell_normkits_modules_of_one_framework_apart() -> None:
    """linen's and nnx's RMSNorm against the same peer: two comparisons, two labels."""
    def label(normkit: str) -> str:
        return compare.Comparison("jax", "cpu", normkit, "flax.linen.RMSNorm", "jax.jit",
                                  "as allocated").label(show_mode=False)

    assert label("normkit.jax.RMSNorm") == "RMSNorm vs flax.linen.RMSNorm"
    assert label("normkit.jax.nnx.RMSNorm") == "nnx.RMSNorm vs flax.linen.RMSNorm"


def test_plot_writes_the_ratios_and_the_detail(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    written = plot.plot(tmp_path / "bench.png", ROWS, title="synthetic")
    assert written == [tmp_path / "bench.png", tmp_path / "bench-gbps.png"]
    for path in written:
        image = matplotlib.image.imread(path)
        assert image.shape[0] >= 200 and image.shape[1] >= 600
        assert image[..., :3].std() > 0.05  # not blank


def test_the_ratio_figure_has_a_column_per_timing_and_its_whole_caption() -> None:
    """Latency left, throughput right, in every row of panels; the caption under them says what
    the timings and the huge-pages view are, and lies inside the figure, not cut off."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = plot.ratio_figure(ROWS)
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)  # lays the figure out
    titles = [ax.get_title(loc="left") for ax in figure.axes]
    assert titles == ["torch on cpu, latency", "torch on cpu, throughput",
                      "torch on cpu (outputs on huge pages), latency",
                      "torch on cpu (outputs on huge pages), throughput"]
    caption = figure._supxlabel
    text = caption.get_text().replace("\n", " ")
    assert "Latency: a wait for the device" in text and "Throughput: 50 calls back to back" in text
    assert MEMORY_NOTE in text
    box = caption.get_window_extent(renderer)
    width, height = figure.bbox.width, figure.bbox.height
    assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height


def test_plot_without_peers_writes_the_detail_only(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = group(1024, {"normkit.torch.RMSNorm": 1.0, "copy (clone)": 0.5})
    assert plot.plot(tmp_path / "bench.png", rows) == [tmp_path / "bench.png"]
    with pytest.raises(ValueError, match="no normkit row has a peer of its kind"):
        plot.ratio_figure(rows)
    with pytest.raises(ValueError, match="no rows to plot"):
        plot.throughput_figure([])


def test_without_matplotlib_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'normkit\[bench\]'"):
        plot.ratio_figure(ROWS)
