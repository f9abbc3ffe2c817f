"""`mmserve bench ... --plot`: the matplotlib figures from small synthetic inputs, and the
clear failure up front when matplotlib is missing (no checkpoint or engine needed)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pytest
from PIL import Image

from mmserve.bench.cli import add_bench_parser
from mmserve.bench.plots import (
    DPI,
    MATPLOTLIB_MISSING,
    check_plot_path,
    plot_latency_cdf,
    plot_sweep,
    plot_timeline,
)
from mmserve.bench.throughput import TimelineStep


def assert_plot(path: str | Path, size: tuple[int, int] | None = None) -> None:
    """``path`` is a PNG of ``size`` pixels (when given) with lines in colour on it: many
    distinct colours, some of them saturated (not only the black, grey and white of axes)."""
    with Image.open(path) as im:
        assert im.format == "PNG"
        if size is not None:
            assert im.size == size
        else:
            assert im.size[0] > 300 and im.size[1] > 300
        rgb = im.convert("RGB")
        colors = rgb.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 20
    saturated = sum(n for n, (r, g, b) in colors if max(r, g, b) - min(r, g, b) > 80)
    assert saturated > 500, saturated


def _steps(n: int = 12) -> list[TimelineStep]:
    rng = random.Random(0)
    steps, t = [], 0.0
    for i in range(n):
        d = rng.uniform(0.01, 0.05)
        t += d + 0.001
        encoded = 196 if i % 4 == 0 else 0
        steps.append(TimelineStep(
            end_s=t, duration_s=d, scheduled_tokens=rng.randint(1, 300), running=min(i, 4),
            waiting=max(0, 4 - i), kv_blocks_used=3 * i, encoder_cache_used_tokens=min(50 * i, 392),
            encoder_cache_borrowed_tokens=max(0, 50 * i - 392), images_encoded=int(encoded > 0),
            image_tokens_encoded=encoded, encoder_s=0.004, schedule_s=0.001, prepare_s=0.001,
            decoder_flops=10**9, encoder_flops=10**8))
    return steps


def _row(param: str, value, k: int) -> dict:
    return {"param": param, "value": value, "output_tokens_per_s": 100.0 + 20 * k,
            "encoder_cache_hit_rate": 0.25 + 0.2 * k, "encoder_items_computed": 10 - k,
            "encoder_cache_evictions": 4 - k, "encoder_cache_kv_pressure_evictions": k,
            "ttft_s": {"median": 0.5 + k, "p99": 1.5 + k},
            "e2e_latency_s": {"median": 2.0 + k, "p99": 3.0 + k}}


def test_timeline_plot(tmp_path) -> None:
    path = tmp_path / "sub" / "steps.png"  # the folder is made
    fig = plot_timeline(_steps(), path)
    w, h = fig.get_size_inches()
    assert_plot(path, (round(w * DPI), round(h * DPI)))
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles == ["Tokens scheduled per step", "Requests", "KV cache", "Encoder cache",
                      "Image tokens encoded per step", "Step time"]
    # Both request counts and both encoder-cache figures have a legend; every panel has a unit.
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == ["running", "waiting"]
    assert len(fig.axes[3].get_legend().get_texts()) == 2
    assert all(ax.get_ylabel() for ax in fig.axes)
    assert fig.axes[-1].get_xlabel().endswith("(s)")
    # Each step is flat over its own interval: two points per step.
    line = fig.axes[5].get_lines()[0]
    steps = _steps()
    assert list(line.get_xdata()[:2]) == pytest.approx(
        [steps[0].end_s - steps[0].duration_s, steps[0].end_s])
    assert list(line.get_ydata()[:2]) == pytest.approx([1e3 * steps[0].duration_s] * 2)


def test_timeline_plot_without_steps(tmp_path) -> None:
    plot_timeline([], tmp_path / "empty.png")
    with Image.open(tmp_path / "empty.png") as im:
        assert im.format == "PNG"


def test_sweep_plot_numeric_values_in_order(tmp_path) -> None:
    rows = [_row("encoder_cache_size", v, k) for k, v in enumerate([784, 196, 392])]
    fig = plot_sweep(rows, tmp_path / "sweep.png")
    assert_plot(tmp_path / "sweep.png")
    ax = fig.axes[0]
    assert ax.get_title() == "Throughput" and ax.get_ylabel() == "output tokens/s"
    assert ax.get_xlabel() == "encoder_cache_size"
    assert list(ax.get_lines()[0].get_xdata()) == [196, 392, 784]  # sorted by value
    assert list(ax.get_lines()[0].get_ydata()) == [120.0, 140.0, 100.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["196", "392", "784"]
    latency = fig.axes[3]
    assert [t.get_text() for t in latency.get_legend().get_texts()] == [
        "TTFT p50", "TTFT p99", "E2E p50", "E2E p99"]


@pytest.mark.parametrize("values, labels", [
    (["queue-aware", "lru"], ["queue-aware", "lru"]),
    ([None, 196, 392], ["auto", "196", "392"]),
    ([True, False], ["True", "False"]),
])
def test_sweep_plot_categorical_values(tmp_path, values, labels) -> None:
    rows = [_row("some_setting", v, k) for k, v in enumerate(values)]
    fig = plot_sweep(rows, tmp_path / "sweep.png")
    assert_plot(tmp_path / "sweep.png")
    for ax in fig.axes:  # categories in the order swept, on every panel
        assert [t.get_text() for t in ax.get_xticklabels()] == labels
    assert len(fig.axes[0].patches) == len(values)  # one bar per value


def test_sweep_plot_leaves_out_figures_the_rows_lack(tmp_path) -> None:
    rows = [{"param": "max_num_seqs", "value": v, "output_tokens_per_s": 10.0 * v,
             "encoder_cache_hit_rate": 0.5} for v in (1, 2, 4)]
    fig = plot_sweep(rows, tmp_path / "sweep.png")
    assert [ax.get_title() for ax in fig.axes if ax.axison] == [
        "Throughput", "Encoder-cache hit rate"]
    assert_plot(tmp_path / "sweep.png")


def test_latency_cdf_plot(tmp_path) -> None:
    rng = random.Random(1)
    ttft = [rng.lognormvariate(5, 0.5) for _ in range(16)]
    itl = [rng.lognormvariate(3, 0.3) for _ in range(200)]
    fig = plot_latency_cdf(ttft, itl, tmp_path / "cdf.png")
    assert_plot(tmp_path / "cdf.png")
    ttft_ax, itl_ax = fig.axes
    assert ttft_ax.get_xlabel() == "TTFT (ms)" and itl_ax.get_xlabel() == "ITL (ms)"
    legend = [t.get_text() for t in ttft_ax.get_legend().get_texts()]
    assert legend[1].startswith("median ") and legend[2].startswith("p99 ")
    cdf = ttft_ax.get_lines()[0]
    assert cdf.get_ydata()[0] == 0 and cdf.get_ydata()[-1] == pytest.approx(1.0)
    assert cdf.get_xdata()[-1] == pytest.approx(max(ttft))


def test_latency_cdf_plot_without_samples(tmp_path) -> None:
    plot_latency_cdf([], [], tmp_path / "cdf.png")
    with Image.open(tmp_path / "cdf.png") as im:
        assert im.format == "PNG"


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_vector_formats_by_suffix(tmp_path, suffix, magic) -> None:
    path = tmp_path / f"cdf{suffix}"
    check_plot_path(path)
    plot_latency_cdf([1.0, 2.0], [0.5, 0.7, 0.6], path)
    assert path.read_bytes().startswith(magic)


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mmserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


# The model does not exist: these pass only if the check comes before anything runs.
COMMANDS = [["throughput"], ["sweep", "--param", "encoder_cache_size=16,64"], ["serve"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_plot_without_matplotlib_fails_up_front(command, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    rc = bench([*command, "--model", str(tmp_path / "no-such-model"),
                "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    assert capsys.readouterr().err.strip() == f"mmserve bench {command[0]}: {MATPLOTLIB_MISSING}"
    assert MATPLOTLIB_MISSING == '--plot needs matplotlib: pip install "mmserve[bench]"'
    assert not (tmp_path / "p.png").exists()
    with pytest.raises(ImportError, match=r"pip install \"mmserve\[bench\]\""):
        plot_timeline(_steps(), tmp_path / "p.png")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_plot_to_a_format_matplotlib_cannot_write_fails_up_front(command, tmp_path,
                                                                 capsys) -> None:
    rc = bench([*command, "--model", str(tmp_path / "no-such-model"),
                "--plot", str(tmp_path / "p.xyz")])
    assert rc == 2
    assert "does not write .xyz files" in capsys.readouterr().err
