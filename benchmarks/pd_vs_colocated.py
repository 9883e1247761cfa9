"""Colocated vs 1P1D: TTFT / TPOT p50 and p99, throughput and goodput at a TPOT SLO, under
one seeded Poisson load.

Both clusters run the same workload (same prompts, same arrival times) in the same run;
1P1D moves every prompt's KV with a real NIXL READ, whose GB/s is reported from the decode
worker's own timing (READ started -> completion seen). Prints a table, the 1P1D /
colocated ratios and the command, and writes a PNG of the latency CDFs. A mode that fails
(a worker dies, an engine fails, requests end in errors) has its errors printed; the table
and PNG still show what ran, and the exit status is 1.

Without --config: tiny CPU engines. With a cluster YAML (e.g. configs/h200-1p1d.yaml, a
prefill and a decode process sharing one GPU), its engine and worker groups are used for
1P1D and the colocated worker gets the GPUs of both groups.

Usage: python benchmarks/pd_vs_colocated.py [--config YAML] [--requests 48] [--rate 6]
       [--max-tokens 32] [--model tiny-ouro] [--launcher process|ray] [--slo-tpot-ms 50]
       [--num-blocks N] [--gpu-features] [--tie-nats 0.25] [--png out/pd_latency_cdf.png]
"""

from __future__ import annotations

import argparse
import sys

from loopserve.bench.pd_compare import add_arguments, compare


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return compare(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
