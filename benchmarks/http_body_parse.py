"""What parsing one HTTP request body costs the event loop, at the body limit.

The HTTP server parses a body on its event loop (pydantic-core's parser holds the GIL, so a
thread would stall the loop all the same); what bounds the stall is the body limit
(server.limits.max_message_bytes). This times the worst bodies of that size (a long text, a
million token ids, many short texts, many id lists, a million ids with a bad last one) through
the server's own `parse_body`, against `json.loads` of the same bytes in the same run (the
floor any JSON parse costs), best of `--repeat`.

    python benchmarks/http_body_parse.py [--limit-mib 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from loopserve.entrypoints.openai.body import parse_body
from loopserve.entrypoints.openai.errors import APIError
from loopserve.entrypoints.openai.protocol import CompletionRequest


def _fill(limit: int, item: object, prefix: list) -> bytes:
    """{"model": "m", "prompt": prefix + [item, item, ...]} as large as fits in `limit` bytes."""
    one = len(json.dumps(item)) + 2
    n = (limit - len(json.dumps({"model": "m", "prompt": prefix})) - 16) // one
    raw = json.dumps({"model": "m", "prompt": prefix + [item] * n}).encode()
    assert len(raw) <= limit, (len(raw), limit)
    return raw


def _bodies(limit: int) -> dict[str, bytes]:
    ids = _fill(limit, 1, [])
    return {
        "one text": json.dumps({"model": "m", "prompt": "x" * (limit - 40)}).encode(),
        "token ids": ids,
        "short texts": _fill(limit, "xy", []),
        "id lists": _fill(limit, [1] * 50, []),
        "ids, last bad": ids[:-2] + b', "x"]}',
    }


def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            fn()
        except APIError:  # a refused body costs what its refusal costs
            pass
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit-mib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    limit = int(args.limit_mib * (1 << 20))
    print(f"{'body':<14} {'bytes':>9} {'json.loads ms':>14} {'parse_body ms':>14} {'ratio':>6}")
    for name, raw in _bodies(limit).items():
        floor = _best(lambda: json.loads(raw), args.repeat)
        ours = _best(lambda: parse_body(raw, CompletionRequest), args.repeat)
        print(f"{name:<14} {len(raw):>9} {floor * 1e3:>14.1f} {ours * 1e3:>14.1f} {ours / floor:>6.2f}")


if __name__ == "__main__":
    main()
