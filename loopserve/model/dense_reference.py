"""The oracle: a plain full-recompute forward of the same weights (no cache, no paging).

Per-token exit with the last-exited rule: a token that exited at depth e is frozen; when later
tokens attend at depth d > e they see its depth-e K/V. The engine must match this token for
token. Only the weight modules are shared with the paged path.
"""

from __future__ import annotations

import torch

from loopserve.model.base import LoopedModel, dense_attend
from loopserve.model.attention.torch_ref import attend
from loopserve.model.exit_rule import exit_mask
from loopserve.model.huginn import HuginnModel
from loopserve.model.ouro import OuroModel


class _FrozenKV:
    """Per looped layer: the K/V every token currently shows to readers (last-exited)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend_fn(self, layer: int, active: torch.Tensor, positions: torch.Tensor, scale: float):
        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer in self.k:
                keep = active[:, None, None]
                k = torch.where(keep, k, self.k[layer])
                v = torch.where(keep, v, self.v[layer])
            self.k[layer], self.v[layer] = k, v
            return attend(q, k, v, positions, positions, scale)

        return fn


def _loop(model: LoopedModel, n: int, step, min_loops: int, max_loops: int, threshold: float):
    """Run loops 1..max_loops; `step(d, active, frozen)` -> (scores [n], commit(mask))."""
    dev = next(model.parameters()).device
    active = torch.ones(n, dtype=torch.bool, device=dev)
    depth = torch.zeros(n, dtype=torch.long, device=dev)
    frozen = _FrozenKV()
    for d in range(1, max_loops + 1):
        scores, commit = step(d, active, frozen)
        commit(active)
        full = lambda x: torch.full((n,), x, device=dev)  # noqa: E731
        exits = active & exit_mask(full(d), scores, full(min_loops), full(max_loops), full(float(threshold)))
        depth[exits] = d
        active = active & ~exits
        if not active.any():
            break
    return depth


@torch.inference_mode()
def dense_forward(model: LoopedModel, token_ids: list[int], min_loops: int, max_loops: int,
                  exit_threshold: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [N, V] (fp32) for every position and each position's exit depth [N]."""
    dev = next(model.parameters()).device
    ids = torch.tensor(token_ids, device=dev)
    pos = torch.arange(len(token_ids), device=dev)
    n = len(token_ids)
    if isinstance(model, HuginnModel):
        e = model.embed(ids)
        for blk in model.transformer.prelude:
            e = blk(e, pos, model.rope, dense_attend(pos, blk.attn.scale))
        x = model.initial_state(torch.full((n,), seed, dtype=torch.int64, device=dev), pos, e)

        def step(d, active, frozen):
            nonlocal x
            h = model.loop_input(x, e)
            for j, blk in enumerate(model.transformer.core_block):
                h = blk(h, pos, model.rope, frozen.attend_fn(j, active, pos, blk.attn.scale))
            scores = model.convergence(h, x)

            def commit(mask):
                nonlocal x
                x = torch.where(mask[:, None], h, x)

            return scores, commit

        depth = _loop(model, n, step, min_loops, max_loops, exit_threshold)
        y = model.transformer.ln_f(x)
        for blk in model.transformer.coda:
            y = blk(y, pos, model.rope, dense_attend(pos, blk.attn.scale))
        return model.head(y), depth
    if isinstance(model, OuroModel):
        h = model.model.embed_tokens(ids)
        remaining = torch.ones(n, device=dev)

        def step(d, active, frozen):
            nonlocal h, remaining
            g = h
            for j, layer in enumerate(model.model.layers):
                g = layer(g, pos, model.rope, frozen.attend_fn(j, active, pos, layer.self_attn.scale))
            g, rem, scores = model.end_of_loop(g, remaining)

            def commit(mask):
                nonlocal h, remaining
                h = torch.where(mask[:, None], g, h)
                remaining = torch.where(mask, rem, remaining)

            return scores, commit

        depth = _loop(model, n, step, min_loops, max_loops, exit_threshold)
        return model.lm_head(h).float(), depth
    raise TypeError(f"no dense reference for {type(model).__name__}")


def dense_greedy_generate(model: LoopedModel, prompt_ids: list[int], max_tokens: int,
                          min_loops: int, max_loops: int, exit_threshold: float,
                          seed: int = 0) -> tuple[list[int], list[int]]:
    """Greedy tokens, recomputing everything each step, and the exit depth of the position
    that produced each token."""
    ids = list(prompt_ids)
    tokens, depths = [], []
    for _ in range(max_tokens):
        logits, depth = dense_forward(model, ids, min_loops, max_loops, exit_threshold, seed)
        tok = int(torch.argmax(logits[-1]).item())
        tokens.append(tok)
        depths.append(int(depth[-1].item()))
        ids.append(tok)
    return tokens, depths
