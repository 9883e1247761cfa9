"""Prefix caching + prefix-aware routing + per-request disaggregation, on vs off, on 2P2D.

Two workloads, each arm on a fresh cluster of process workers (tiny CPU engines), the same
seeded requests and Poisson arrival times for every arm, in one run:
- shared prefix: 16 system prompts of 1024 tokens, user turns of 50-200 tokens; arms off
  (no caching, load-only routing, every prompt prefilled remotely), cache+route (the
  defaults) and all (the defaults with --local-prefill-tokens).
- short prompts: unrelated 5-40-token prompts; arms remote (threshold 0, the default) and
  local (prompts under --local-prefill-tokens prefilled on their decode worker).
- --sweep N...: the short workload with prompts of exactly N tokens, remote vs local, per N:
  the serving path's view of where local prefill stops paying.
Prints per arm TTFT p50/p99, TPOT p50, output throughput, the share of prompt tokens found
cached, the KV bytes read over NIXL, where prompts were prefilled; ratios against the first
arm; whether greedy tokens are equal across arms; and the command. Exit status 1 if an arm
could not run, a request failed or a greedy stream differs.

Usage: python benchmarks/prefix_pd.py [--requests 160] [--rate 2] [--local-prefill-tokens 64]
       [--workloads shared-prefix short] [--sweep 16 64 256 1024] [--model tiny-ouro]
"""

from __future__ import annotations

import argparse
import sys

from loopserve.bench.prefix_pd import add_arguments, main

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    sys.exit(main(p.parse_args()))
