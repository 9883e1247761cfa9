"""The `loopserve` command line: generate (one-shot), serve (gRPC + OpenAI HTTP cluster),
client, bench serve (a serving benchmark against a running server)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from loopserve.bench.serve import add_args as add_bench_args
from loopserve.cluster.config import SERVER_FLAGS, add_server_args


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--min-loops", type=int, default=None)
    p.add_argument("--max-loops", type=int, default=None)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--stop", action="append", default=[])


def _sampling(args: argparse.Namespace):
    from loopserve.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, min_loops=args.min_loops, max_loops=args.max_loops,
        exit_threshold=args.exit_threshold, stop=tuple(args.stop),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from loopserve.engine.llm import LLM

    overrides = {"model": args.model} if args.model else {}
    if args.device:
        overrides["device"] = args.device
    llm = LLM(args.config, **overrides)
    for out in llm.generate(args.prompts, _sampling(args)):
        if args.json:
            print(json.dumps({"request_id": out.request_id, "prompt_token_ids": out.prompt_token_ids,
                              "text": out.text, "token_ids": out.token_ids,
                              "exit_depths": out.exit_depths,
                              "finish_reason": out.finish_reason}))
        else:
            print(f"--- {out.request_id} ({out.finish_reason}; exit depths {out.exit_depths})")
            print(out.text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from loopserve.cluster.job import main as job_main

    argv = ["--serve"] + (["--config", args.config] if args.config else [])
    argv += [f"--{k.replace('_', '-')}={v}" for k in ("duration", *SERVER_FLAGS)
             if (v := getattr(args, k)) is not None]
    return job_main(argv)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def cmd_client(args: argparse.Namespace) -> int:
    from loopserve.cluster.client import LoopServeClient
    from loopserve.cluster.config import AUTH_TOKEN_ENV

    import grpc

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    token = args.token or os.environ.get(AUTH_TOKEN_ENV)
    with LoopServeClient(args.address, token=token, tls=args.tls, root_certificates=_read(args.tls_ca),
                         private_key=_read(args.tls_key), certificate_chain=_read(args.tls_cert)) as client:
        done = None
        try:
            for event in client.generate(args.prompt, _sampling(args), request_id=args.request_id):
                if event.kind == "chunk":
                    print(event.text, end="", flush=True)
                elif event.kind == "complete":
                    done = event
                else:
                    print(f"\nloopserve: error: {event.error}", file=sys.stderr)
                    return 1
        except grpc.RpcError as e:
            print(f"loopserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(f"\n--- {done.finish_reason}; {done.completion_tokens} tokens", file=sys.stderr)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from loopserve.bench.serve import bench_serve

    return bench_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loopserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate for prompts on a colocated engine and exit")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--config", default=None, help="engine YAML (default: built-in tiny CPU model)")
    g.add_argument("--model", default=None, help="a model name in loopserve/model/configs or an HF-format directory")
    g.add_argument("--device", default=None)
    g.add_argument("--json", action="store_true", help="one JSON object per line")
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="start a PD (or colocated) cluster behind the gRPC and "
                       "OpenAI-compatible HTTP servers")
    s.add_argument("--config", default=None, help="cluster YAML (default: the embedded cpu-1p1d)")
    add_server_args(s)
    s.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    s.set_defaults(func=cmd_serve)
    c = sub.add_parser("client", help="stream one reply from a running `loopserve serve`")
    c.add_argument("prompt")
    c.add_argument("--address", default="127.0.0.1:50051")
    c.add_argument("--request-id", default=None)
    c.add_argument("--token", default=None, help="bearer token (default: $LOOPSERVE_AUTH_TOKEN, "
                   "which keeps it out of the process list)")
    c.add_argument("--tls", action="store_true", help="TLS, trusting the system's root certificates")
    c.add_argument("--tls-ca", default=None, help="TLS, trusting this PEM root certificate")
    c.add_argument("--tls-cert", default=None, help="client certificate PEM (servers requiring mTLS)")
    c.add_argument("--tls-key", default=None, help="client private key PEM (with --tls-cert)")
    _add_sampling_args(c)
    c.set_defaults(func=cmd_client)
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bs = b.add_parser("serve", help="a seeded serving benchmark against a running `loopserve serve`")
    add_bench_args(bs)
    bs.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        for line in str(e).splitlines():  # one problem per line
            print(f"loopserve: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
