"""`bench serve` figures: per-level summaries, the Markdown table and the plot."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from pagedserve.bench.serve_client import RequestResult


@dataclass
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_s: list[float]) -> Percentiles | None:
        if not values_s:
            return None
        ms = np.asarray(values_s) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass
class LevelResult:
    concurrency: int
    num_prompts: int
    completed: int
    errors: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_throughput: float  # output tokens/s over the level's wall time
    request_throughput: float  # completed requests/s
    ttft_ms: Percentiles | None
    tpot_ms: Percentiles | None  # None without streaming: there is no per-token timing
    itl_ms: Percentiles | None
    latency_ms: Percentiles | None  # end to end, per request
    error_samples: list[str] = field(default_factory=list)
    prefix_hit_rate: float | None = None  # from the server's /metrics, where it has them


def summarize(
    concurrency: int, results: list[RequestResult], duration_s: float, stream: bool
) -> LevelResult:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return LevelResult(
        concurrency=concurrency,
        num_prompts=len(results),
        completed=len(good),
        errors=len(errors),
        duration_s=duration_s,
        input_tokens=sum(r.prompt_tokens or 0 for r in good),
        output_tokens=out_tokens,
        output_throughput=out_tokens / duration_s if duration_s > 0 else 0.0,
        request_throughput=len(good) / duration_s if duration_s > 0 else 0.0,
        ttft_ms=Percentiles.of([r.ttft_s for r in good]),
        tpot_ms=Percentiles.of(tpot) if stream else None,
        itl_ms=Percentiles.of([x for r in good for x in r.itl_s]) if stream else None,
        latency_ms=Percentiles.of([r.latency_s for r in good]),
        error_samples=sorted(set(errors))[:5],
    )


def _pct(p: Percentiles | dict | None) -> str:
    if p is None:
        return "-"
    d = dataclasses.asdict(p) if isinstance(p, Percentiles) else p
    return f"{d['p50']:.0f} / {d['p90']:.0f} / {d['p99']:.0f}"


def format_table(levels: list[LevelResult] | list[dict]) -> str:
    """A Markdown table of the levels (results or their JSON form)."""
    dicts = [dataclasses.asdict(lv) if isinstance(lv, LevelResult) else lv for lv in levels]
    hits = any(d.get("prefix_hit_rate") is not None for d in dicts)
    rows = [
        "| concurrency | completed | errors | duration (s) | output tok/s | req/s "
        "| TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) |"
        + (" prefix hit rate |" if hits else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if hits else ""),
    ]
    for d in dicts:
        rate = d.get("prefix_hit_rate")
        rows.append(
            f"| {d['concurrency']} | {d['completed']}/{d['num_prompts']} | {d['errors']} "
            f"| {d['duration_s']:.1f} | {d['output_throughput']:.1f} "
            f"| {d['request_throughput']:.2f} | {_pct(d['ttft_ms'])} | {_pct(d['tpot_ms'])} "
            f"| {_pct(d['itl_ms'])} |"
            + ((f" {100 * rate:.1f}% |" if rate is not None else " - |") if hits else "")
        )
    return "\n".join(rows)


def plot(series: dict[str, list[dict]], path: str, title: str = "") -> None:
    """Output tokens/s and latency against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    ticks = sorted({lv["concurrency"] for levels in series.values() for lv in levels})
    for i, (name, levels) in enumerate(series.items()):
        color = f"C{i}"
        xs = [lv["concurrency"] for lv in levels]
        ax_tp.plot(xs, [lv["output_throughput"] for lv in levels], "o-", color=color, label=name)
        ttft = [lv["ttft_ms"]["p50"] if lv["ttft_ms"] else math.nan for lv in levels]
        streamed = any(lv["tpot_ms"] for lv in levels)
        label = f"{name} TTFT p50" if streamed else f"{name} latency p50 (not streamed)"
        ax_lat.plot(xs, ttft, "o-", color=color, label=label)
        if streamed:
            tpot = [lv["tpot_ms"]["p50"] if lv["tpot_ms"] else math.nan for lv in levels]
            ax_lat.plot(xs, tpot, "s--", color=color, label=f"{name} TPOT p50")
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_ylim(bottom=0)
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
