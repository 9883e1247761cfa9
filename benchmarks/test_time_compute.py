"""Test-time compute on the shipped `tiny-ouro-chains` model, through the engine (greedy):
accuracy vs max_loops 1..N per chain depth, and adaptive exit's accuracy and mean loops per
token vs exit_threshold, on a held-out set (seed unlike training's 0 and validation's 1).

    PYTHONPATH=. python benchmarks/test_time_compute.py --out docs/img/test_time_compute.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from loopserve.checkpoints.chains import MAX_DEPTH, make_problems
from loopserve.checkpoints.chains_eval import Score, score
from loopserve.engine.llm import LLM

THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99)


def plot(fixed: list[Score], adaptive: list[tuple[float, Score]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    loops = range(1, len(fixed) + 1)
    for d in range(MAX_DEPTH):
        a.plot(loops, [s.by_depth[d] for s in fixed], marker="o", alpha=0.6, label=f"depth {d + 1}")
    a.plot(loops, [s.accuracy for s in fixed], marker="s", color="k", lw=2, label="all")
    a.set(xlabel="max_loops (fixed depth)", ylabel="accuracy", title="more loops answer better",
          xticks=list(loops), ylim=(0, 1.02))
    a.legend(fontsize=8)
    b.plot([s.mean_loops for _, s in adaptive], [s.accuracy for _, s in adaptive], marker="o", label="adaptive exit")
    for t, s in adaptive:
        b.annotate(f"{t}", (s.mean_loops, s.accuracy), fontsize=8, xytext=(3, -10), textcoords="offset points")
    b.plot([s.mean_loops for s in fixed], [s.accuracy for s in fixed], marker="s", color="k", label="fixed depth")
    b.set(xlabel="mean loops per token", ylabel="accuracy", title="adaptive exit (labels: exit_threshold)",
          ylim=(0, 1.02))
    b.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-ouro-chains")
    ap.add_argument("--n", type=int, default=1200, help="held-out problems (equal per depth)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", type=Path, default=Path("docs/img/test_time_compute.png"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("$ PYTHONPATH=. python " + " ".join(sys.argv))
    llm = LLM(model=args.model)
    problems = make_problems(args.seed, args.n)
    fixed = [score(llm, problems, k) for k in range(1, llm.engine.model.max_loops + 1)]
    adaptive = [(t, score(llm, problems, None, t)) for t in THRESHOLDS]
    depths = " | ".join(f"d={d}" for d in range(1, MAX_DEPTH + 1))
    print(f"| max_loops | exit_threshold | accuracy | mean loops/token | {depths} |")
    print("|---" * (4 + MAX_DEPTH) + "|")
    rows = [(str(k), "1.0 (fixed)", s) for k, s in enumerate(fixed, 1)]
    rows += [(str(len(fixed)), str(t), s) for t, s in adaptive]
    for loops, t, s in rows:
        per = " | ".join(f"{a:.2f}" for a in s.by_depth)
        print(f"| {loops} | {t} | {s.accuracy:.3f} | {s.mean_loops:.2f} | {per} |")
    plot(fixed, adaptive, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
