"""What `loopserve bench serve` reports, as `vllm bench serve` does: completed / failed,
throughputs, goodput at TTFT/TPOT SLOs, and TTFT / TPOT / ITL / E2E mean, median and p99
(milliseconds); the table, the JSON result and the latency CDFs (PNG)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from loopserve.bench.backends import RequestTrace

LATENCIES = ("ttft", "tpot", "itl", "e2e")


def _percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def samples(traces: list[RequestTrace]) -> dict[str, list[float]]:
    """Each latency's samples in ms over the completed requests."""
    ok = [t for t in traces if t.ok]
    return {"ttft": [t.ttft * 1e3 for t in ok if t.ttft is not None],
            "tpot": [t.tpot * 1e3 for t in ok if t.tpot is not None],
            "itl": [x * 1e3 for t in ok for x in t.itls],
            "e2e": [t.e2e * 1e3 for t in ok]}


def summarize(traces: list[RequestTrace], duration: float, slos: dict[str, float]) -> dict:
    """`slos`: {"ttft": ms, "tpot": ms}; a completed request within all of them is good."""
    ok = [t for t in traces if t.ok]
    out_tokens = sum(t.output_tokens for t in ok)
    in_tokens = sum(t.prompt_tokens for t in ok)
    result: dict = {
        "duration_s": duration, "completed": len(ok), "failed": len(traces) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "errors": sorted({t.error for t in traces if t.error})[:10],
    }
    if slos:
        good = [t for t in ok if all((getattr(t, k) or 0.0) * 1e3 <= v for k, v in slos.items())]
        result["goodput_slos_ms"] = slos
        result["request_goodput"] = len(good) / duration
    for name, xs in samples(traces).items():
        result[f"{name}_ms"] = ({"mean": statistics.fmean(xs), "median": statistics.median(xs),
                                 "p99": _percentile(xs, 99)} if xs else None)
    return result


def table(result: dict) -> str:
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", f"{result['duration_s']:.2f}"),
            ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}")]
    if "request_goodput" in result:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
    for name in LATENCIES:
        if stats := result[f"{name}_ms"]:
            rows += [(f"{k.capitalize()} {name.upper()} (ms)", f"{v:.2f}") for k, v in stats.items()]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def write_json(result: dict, traces: list[RequestTrace], path: Path) -> None:
    per_request = [{"ok": t.ok, "error": t.error, "prompt_tokens": t.prompt_tokens,
                    "output_tokens": t.output_tokens, "ttft_s": t.ttft, "e2e_s": t.e2e,
                    "itl_s": t.itls} for t in traces]
    path.write_text(json.dumps({**result, "requests": per_request}, indent=1))


def plot_cdfs(traces: list[RequestTrace], path: Path, title: str) -> None:
    """One CDF panel per latency (matplotlib, the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, xs) in zip(axes.flat, samples(traces).items()):
        xs = sorted(xs)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
        ax.set(title=name.upper(), xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
