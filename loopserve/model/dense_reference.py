"""The oracle: a plain full-recompute forward of the same weights (no cache, no paging).

Per-token exit with the last-exited rule: a token that exited at depth e is frozen; when later
tokens attend at depth d > e they see its depth-e K/V. The engine must match this token for
token. Only the weight modules are shared with the paged path.
"""

from __future__ import annotations

import torch

from loopserve.model.base import LoopedModel, dense_attend
from loopserve.model.attention.torch_ref import attend
from loopserve.model.dory import DoryModel, l2norm
from loopserve.model.exit_rule import exit_mask
from loopserve.model.huginn import HuginnModel
from loopserve.model.layers import rotating
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

        return rotating(fn)


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


def _dory_forward(model: DoryModel, ids: torch.Tensor, min_loops: int, max_loops: int,
                  exit_threshold: float, prompt_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dory: no gate (score 0), so every token runs the same loop count. per_loop: one plain
    pass, loop d attends to loop d's K/V. last_loop (transformers' semantics): the prompt is
    one piece, then one piece per token; loop d of a piece attends to the earlier pieces'
    LAST-loop K/V plus its own loop-d K/V."""
    n = ids.shape[0]
    loops = next(d for d in range(1, max_loops + 1)
                 if bool(exit_mask(torch.tensor([d]), torch.zeros(1), torch.tensor([min_loops]),
                                   torch.tensor([max_loops]), torch.tensor([float(exit_threshold)]))[0]))
    cuts = [0, n]
    if model.last_loop_kv and prompt_len is not None and prompt_len < n:
        cuts = [0] + list(range(max(prompt_len, 1), n + 1))
    past: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def attend_fn(key: str, layer, pos: torch.Tensor, store: bool):
        a = layer.self_attn

        def fn(q, k, v):
            kp, kk, vv = pos, k, v
            if key in past:
                p0, k0, v0 = past[key]
                kp, kk, vv = torch.cat([p0, pos]), torch.cat([k0, k]), torch.cat([v0, v])
            if store:
                past[key] = (kp, kk, vv)
            return attend(q, kk, vv, pos, kp, a.scale, a.window)

        return fn

    logits = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        pos = torch.arange(a, b, device=ids.device)
        h, rots = model.model.embed_tokens(ids[a:b]), model.rotations(pos)
        for i, layer in enumerate(model.input_layers):
            h = model.run_layer(layer, h, rots, attend_fn(f"in{i}", layer, pos, True))
        inp = l2norm(h)
        for d in range(1, loops + 1):
            h = model.loop_input(h, inp)
            for j, layer in enumerate(model.recurrent_layers):
                key = f"rec{j}" if model.last_loop_kv else f"rec{j}@{d}"
                store = d == loops or not model.last_loop_kv
                h = model.run_layer(layer, h, rots, attend_fn(key, layer, pos, store))
        for j, layer in enumerate(model.output_layers):
            h = model.run_layer(layer, h, rots, attend_fn(f"out{j}", layer, pos, True))
        logits.append(model.head(h))
    return torch.cat(logits), torch.full((n,), loops, dtype=torch.long)


@torch.inference_mode()
def dense_forward(model: LoopedModel, token_ids: list[int], min_loops: int, max_loops: int,
                  exit_threshold: float, seed: int = 0,
                  prompt_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [N, V] (fp32) for every position and each position's exit depth [N].

    `prompt_len` matters only for Dory's "last_loop" KV mode (the prompt is one piece, later
    tokens one at a time); other families ignore it."""
    dev = next(model.parameters()).device
    ids = torch.tensor(token_ids, device=dev)
    pos = torch.arange(len(token_ids), device=dev)
    n = len(token_ids)
    if isinstance(model, DoryModel):
        return _dory_forward(model, ids, min_loops, max_loops, exit_threshold, prompt_len)
    if isinstance(model, HuginnModel):
        e, rot = model.embed(ids), model.rope(pos)
        for blk in model.transformer.prelude:
            e = blk(e, rot, dense_attend(pos, blk.attn.scale))
        x = model.initial_state(torch.full((n,), seed, dtype=torch.int64, device=dev), pos, e)

        def step(d, active, frozen):
            nonlocal x
            h = model.loop_input(x, e)
            for j, blk in enumerate(model.transformer.core_block):
                h = blk(h, rot, frozen.attend_fn(j, active, pos, blk.attn.scale))
            scores = model.convergence(h, x)

            def commit(mask):
                nonlocal x
                x = torch.where(mask[:, None], h, x)

            return scores, commit

        depth = _loop(model, n, step, min_loops, max_loops, exit_threshold)
        y = model.transformer.ln_f(x)
        for blk in model.transformer.coda:
            y = blk(y, rot, dense_attend(pos, blk.attn.scale))
        return model.head(y), depth
    if isinstance(model, OuroModel):
        h, rot = model.model.embed_tokens(ids), model.rope(pos)
        remaining = torch.ones(n, device=dev)

        def step(d, active, frozen):
            nonlocal h, remaining
            g = model.run_layers(h, rot, lambda j, layer: frozen.attend_fn(j, active, pos, layer.self_attn.scale))
            rem, scores = model.end_of_loop(g, remaining)

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
        logits, depth = dense_forward(model, ids, min_loops, max_loops, exit_threshold, seed,
                                      prompt_len=len(prompt_ids))
        tok = int(torch.argmax(logits[-1]).item())
        tokens.append(tok)
        depths.append(int(depth[-1].item()))
        ids.append(tok)
    return tokens, depths
