"""The `loopserve` command line: generate (one-shot), serve (gRPC + OpenAI HTTP cluster),
client, bench serve (a serving benchmark against a running server)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loopserve.bench.serve import add_args as add_bench_args
from loopserve.cli_format import HelpFormatter
from loopserve.cluster.config import SERVER_FLAGS, add_server_args
from loopserve.engine.config import DEFAULT_MODEL

if TYPE_CHECKING:
    from loopserve.entrypoints.grpc.protocol import StreamEvent


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1: all")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: one derived from the engine's seed)")
    p.add_argument("--min-loops", type=int, default=None,
                   help="loops every token runs before it may exit (default: the model's)")
    p.add_argument("--max-loops", type=int, default=None,
                   help="loops a token runs at most (default: the model's loop count)")
    p.add_argument("--exit-threshold", type=float, default=None,
                   help="a token exits once its exit gate's cumulative probability reaches this; "
                   "1.0: fixed depth (default: the model's)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT; repeat for several")


def _sampling(args: argparse.Namespace):
    from loopserve.protocol.sampling_params import SamplingParams

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
    from loopserve.job import main as job_main

    argv = ["--serve"] + (["--config", args.config] if args.config else [])
    argv += [f"--{k.replace('_', '-')}={v}" for k in ("duration", *SERVER_FLAGS)
             if (v := getattr(args, k)) is not None]
    return job_main(argv)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def cmd_client(args: argparse.Namespace) -> int:
    from loopserve.cluster.config import AUTH_TOKEN_ENV
    from loopserve.entrypoints.grpc.client import LoopServeClient

    import grpc

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    token = args.token or os.environ.get(AUTH_TOKEN_ENV)
    with LoopServeClient(args.address, token=token, tls=args.tls, root_certificates=_read(args.tls_ca),
                         private_key=_read(args.tls_key), certificate_chain=_read(args.tls_cert)) as client:
        done, depths = None, []
        try:
            for event in client.generate(args.prompt, _sampling(args), request_id=args.request_id):
                if event.kind == "chunk":
                    print(event.text, end="", flush=True)
                    depths.extend(event.exit_depths)
                elif event.kind == "complete":
                    done = event
                else:
                    print(f"\nloopserve: error: {event.error}", file=sys.stderr)
                    return 1
        except grpc.RpcError as e:
            print(f"loopserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(f"\n{summary_line(done, depths)}", file=sys.stderr)
    return 0


def summary_line(done: StreamEvent, exit_depths: list[int]) -> str:
    """How the reply ended and the loops each token ran (the point of a looped model); on
    stderr, so that stdout is the reply alone."""
    return f"--- {done.finish_reason}; {done.completion_tokens} tokens; exit depths {exit_depths}"


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from loopserve.bench.serve import bench_serve

    return bench_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loopserve", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(subparsers, name: str, help: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)

    g = command(sub, "generate", "generate for prompts on a colocated engine and exit")
    g.add_argument("prompts", nargs="+", help="one or more prompts (one character is one token "
                   "with the byte tokenizer of the embedded models)")
    g.add_argument("--config", default=None, help="engine YAML (default: EngineConfig's defaults, "
                   f"model {DEFAULT_MODEL} on the CPU)")
    g.add_argument("--model", default=None, help="a model name in loopserve/model/configs or "
                   f"loopserve/checkpoints, or an HF-format directory (default: the config's, else {DEFAULT_MODEL})")
    g.add_argument("--device", default=None, help="e.g. cpu, cuda (default: the config's, else cpu)")
    g.add_argument("--json", action="store_true", help="one JSON object per line")
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    s = command(sub, "serve", "start a PD (or colocated) cluster behind the gRPC and "
                "OpenAI-compatible HTTP servers")
    s.add_argument("--config", default=None, help="cluster YAML (default: the embedded cpu-1p1d)")
    add_server_args(s)
    s.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    s.set_defaults(func=cmd_serve)
    c = command(sub, "client", "stream one reply from a running `loopserve serve` (gRPC): the text "
                "on stdout, then on stderr how it ended and each token's exit depth (loops it ran)")
    c.add_argument("prompt", help="the prompt text")
    c.add_argument("--address", default="127.0.0.1:50051", help="the server's gRPC address")
    c.add_argument("--request-id", default=None, help="the request's id (default: the server assigns one)")
    c.add_argument("--token", default=None, help="bearer token (default: $LOOPSERVE_AUTH_TOKEN, "
                   "which keeps it out of the process list)")
    c.add_argument("--tls", action="store_true", help="TLS, trusting the system's root certificates")
    c.add_argument("--tls-ca", default=None, help="TLS, trusting this PEM root certificate")
    c.add_argument("--tls-cert", default=None, help="client certificate PEM (servers requiring mTLS)")
    c.add_argument("--tls-key", default=None, help="client private key PEM (with --tls-cert)")
    _add_sampling_args(c)
    c.set_defaults(func=cmd_client)
    b = command(sub, "bench", "benchmarks").add_subparsers(dest="bench", required=True)
    bs = command(b, "serve", "a seeded serving benchmark against a running `loopserve serve`")
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
