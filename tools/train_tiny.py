"""Train the shipped `tiny-ouro-chains` model: a small Ouro-style looped LM (2 layers looped
4 times, hidden 64, 0.13M parameters) on chained variable lookups
(loopserve/checkpoints/chains.py), on CPU, seeded and reproducible:

    PYTHONPATH=. python tools/train_tiny.py --out loopserve/checkpoints/tiny-ouro-chains

(8000 steps of 64 prompts, then 1000 gate-only steps: 14 min 49 s wall, 12 min 27 s CPU, on
one thread of the project's 2-core sandbox shared with other jobs. Same machine, same seed:
the same weights, step for step; another CPU's float rounding may take another path.)

Stage I is Ouro's objective: a cross-entropy at every loop t, weighted by the exit gate's
distribution p(t) = λ_t Π_{j<t}(1 − λ_j) (the last loop takes the remaining mass), minus
β·H(p), plus the plain mean of the per-loop cross-entropies (so every loop's answer keeps
learning while the gate is unsure). Only the answer byte and its EOS are scored.

What made it learn (the first attempt, 8 statements and 1..6 hops from the start, stayed at
guessing a prompt digit):
- a curriculum over (statements, deepest chain): 2 statements/1 hop, then 3/2, 4/3, then the
  task (6 statements, 1..4 hops), each stage ending at 90% training accuracy. With two or
  more distractors the lookup circuit (the value byte reads its name two bytes back, the
  query matches names) sits on a loss plateau for 3000+ steps, even without looping; with
  one it is found in ~1000-1500 and then carries over.
- a direction shared by all token embeddings at init (`--embed-mean`): RoPE's q·k then has a
  content-free part, from which the "two bytes back" heads grow (on 2-statement lookups: 0.95
  accuracy after 3000 steps instead of 0.86).
- a smaller, faster model (hidden 64, 4 full heads) and more steps in the same time.

Stage II is Ouro's focused gate training: the LM frozen, the gate's exit probability λ_t is
fit to 1 − σ(k·(I_t − γ)), I_t the loss improvement still to come after loop t (Ouro compares
with the next loop; here with the best later loop, and γ = 0.1 nats, since one hop may take
two loops). Prompt positions are fit to continue, so the prompt's K/V is every loop's, as in
training, and the engine's adaptive exit reads the same gate: it exits once
1 − Π_{j≤t}(1 − λ_j) reaches `exit_threshold`. The forward is plain PyTorch over the model's
own parameters, batched; at the end it is checked against loopserve's dense reference of the
saved checkpoint.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from loopserve.checkpoints import chains
from loopserve.checkpoints.chains import Problem, make_problem
from loopserve.model.config import parse_config
from loopserve.model.dense_reference import dense_forward
from loopserve.model.ouro import OuroDecoderLayer, OuroModel
from loopserve.model.registry import build_model, load_model, save_model
from loopserve.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def model_config(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, loops: int) -> dict:
    return {
        "architectures": ["OuroForCausalLM"], "model_type": "ouro",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "intermediate_size": ffn,
        "vocab_size": 384, "max_position_embeddings": 512, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
        "total_ut_steps": loops, "early_exit_threshold": 1.0,
    }


def encode(problems: list[Problem], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] (prompt, answer, EOS, padding) and `scored` [B, L-1], the positions whose
    next token is scored (the answer's bytes and the EOS)."""
    rows = [TOK.encode(p.prompt) + TOK.encode(p.answer) + [TOK.eos_token_id] for p in problems]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), TOK.pad_token_id)
    scored = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for i, (p, row) in enumerate(zip(problems, rows)):
        ids[i, :len(row)] = torch.tensor(row)
        scored[i, len(TOK.encode(p.prompt)) - 1:len(row) - 1] = True
    return ids.to(device), scored.to(device)


def layer_forward(layer: OuroDecoderLayer, x: torch.Tensor, rot, n_heads: int, n_kv: int) -> torch.Tensor:
    """OuroDecoderLayer's math on [B, L, D] with autograd through the separate q/k/v and
    gate/up weights (the serving path reads them merged, without gradients)."""
    b, l, _ = x.shape
    attn, mlp = layer.self_attn, layer.mlp
    h = layer.input_layernorm(x)
    q = rot(F.linear(h, attn.q_proj.weight).view(b, l, n_heads, attn.hd)).transpose(1, 2)
    k = rot(F.linear(h, attn.k_proj.weight).view(b, l, n_kv, attn.hd)).transpose(1, 2)
    v = F.linear(h, attn.v_proj.weight).view(b, l, n_kv, attn.hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale, enable_gqa=True)
    x = x + layer.input_layernorm_2(attn.o_proj(o.transpose(1, 2).reshape(b, l, -1)))
    h = layer.post_attention_layernorm(x)
    up = F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight)
    return x + layer.post_attention_layernorm_2(mlp.down_proj(up))


def loop_outputs(model: OuroModel, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per loop: logits [B, L, V] and exit-gate logits [B, L] (every position runs every loop)."""
    cfg = model.config
    rot = model.rope(torch.arange(ids.shape[1], device=ids.device))
    h = model.model.embed_tokens(ids)
    logits, gates = [], []
    for _ in range(cfg.loop_max):
        for layer in model.model.layers:
            h = layer_forward(layer, h, rot, cfg.num_attention_heads, cfg.kv_heads)
        h = model.model.norm(h)
        logits.append(model.lm_head(h))
        gates.append(model.model.early_exit_gate(h).squeeze(-1))
    return logits, gates


def exit_distribution(gates: list[torch.Tensor]) -> torch.Tensor:
    """p(t) [T, ...]: exit at loop t with probability λ_t Π_{j<t}(1 − λ_j); the last loop
    takes what is left, so p sums to 1 and its CDF is the engine's exit score."""
    if len(gates) == 1:
        return torch.ones_like(gates[0])[None]
    lam = torch.sigmoid(torch.stack(gates[:-1]))
    stay = torch.cumprod(1 - lam, dim=0)
    before = torch.cat([torch.ones_like(stay[:1]), stay[:-1]])
    return torch.cat([lam * before, stay[-1:]])


def objective(model: OuroModel, ids: torch.Tensor, scored: torch.Tensor, beta: float, aux: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ouro's stage I, Σ_t p(t)·CE_t − β·H(p) over scored positions, + aux·mean_t CE_t (every
    loop's answer trained whatever the gate says, so early loops keep learning while the gate
    is still uncertain). Returns (loss, CE per loop [T], whether the last loop's answer byte
    is right [B])."""
    logits, gates = loop_outputs(model, ids[:, :-1])
    target = ids[:, 1:][scored]
    first = scored.float().argmax(1)
    rows = torch.arange(ids.shape[0], device=ids.device)
    ok = (logits[-1][rows, first].argmax(-1) == ids[rows, first + 1]).detach()
    ce = torch.stack([F.cross_entropy(lg[scored], target, reduction="none") for lg in logits])
    p = exit_distribution([g[scored] for g in gates])
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(0)
    loss = ((p * ce).sum(0) - beta * entropy).mean() + aux * ce.mean()
    return loss, ce.detach().mean(1), ok


def gate_objective(model: OuroModel, ids: torch.Tensor, scored: torch.Tensor, k: float, gamma: float
                   ) -> torch.Tensor:
    """Ouro's stage II (focused adaptive gate training), with the LM frozen: at loop t the
    gate's exit probability λ_t is fit (binary cross-entropy) to 1 − w_t, where
    w_t = σ(k·(I_t − γ)) is the ideal continuation probability and I_t the (detached) loss
    improvement still to come, CE_t − min_{s>t} CE_s. Prompt positions are fit to continue
    (w = 1): the engine runs a prompt token until its own gate fires, and the answer reads
    the prompt's K/V at every loop it runs, as in training."""
    prompt = torch.zeros_like(scored)
    for i, first in enumerate(scored.float().argmax(1).tolist()):
        prompt[i, :first] = True
    with torch.no_grad():
        cfg = model.config
        rot = model.rope(torch.arange(ids.shape[1] - 1, device=ids.device))
        h = model.model.embed_tokens(ids[:, :-1])
        target = ids[:, 1:][scored]
        hidden, ce = [], []
        for _ in range(cfg.loop_max):
            for layer in model.model.layers:
                h = layer_forward(layer, h, rot, cfg.num_attention_heads, cfg.kv_heads)
            h = model.model.norm(h)
            hidden.append(h)
            ce.append(F.cross_entropy(model.lm_head(h[scored]), target, reduction="none"))
        ce = torch.stack(ce)  # [T, N]
        later = torch.flip(torch.cummin(torch.flip(ce, [0]), 0).values, [0])  # min over s >= t
        improve = (ce[:-1] - later[1:]).clamp_min(0)
        stay = torch.sigmoid(k * (improve - gamma))  # [T-1, N]
    gate = model.model.early_exit_gate
    loss = 0.0
    for t in range(cfg.loop_max - 1):  # the last loop always exits
        logit_a = gate(hidden[t][scored]).squeeze(-1)
        logit_p = gate(hidden[t][prompt]).squeeze(-1)
        loss = loss + F.binary_cross_entropy_with_logits(logit_a, 1 - stay[t]) \
            + F.binary_cross_entropy_with_logits(logit_p, torch.zeros_like(logit_p))
    return loss / (cfg.loop_max - 1)


@torch.no_grad()
def evaluate(model: OuroModel, problems: list[Problem], thresholds=(0.3, 0.5, 0.7, 0.9)) -> dict:
    """Teacher-forced answer-byte accuracy per loop and per depth, and adaptive exit on the
    answer position (prompt positions all loops, as the trained gate keeps them)."""
    dev = next(model.parameters()).device
    ids, scored = encode(problems, dev)
    logits, gates = loop_outputs(model, ids[:, :-1])
    first = scored.float().argmax(1)
    rows = torch.arange(len(problems), device=dev)
    want = ids[rows, first + 1]
    ok = torch.stack([lg[rows, first].argmax(-1) == want for lg in logits])  # [T, B]
    depth = torch.tensor([p.depth for p in problems], device=dev)
    per_depth = [[round(float(o[depth == d].float().mean()), 2) for d in range(1, chains.MAX_DEPTH + 1)]
                 for o in ok]
    p = exit_distribution([g[rows, first] for g in gates])
    cdf = p.cumsum(0)
    adaptive = {}
    for t in thresholds:
        reached = cdf >= t
        reached[-1] = True
        k = reached.float().argmax(0)
        acc = float(ok[k, rows].float().mean())
        adaptive[t] = (round(acc, 3), round(float(k.float().mean() + 1), 2))
    return {"acc": [round(float(o.float().mean()), 3) for o in ok], "by_depth": per_depth,
            "adaptive": adaptive}


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


class Curriculum:
    """Stages of (statements per prompt, deepest chain): depths uniform over 1..deepest. A
    stage ends once the training batches' answer accuracy at the last loop (an EMA over
    steps) reaches `advance_at`, or after `max_steps` steps in it; the last stage is the task
    itself and lasts to the end. Few statements first: the lookup circuit (a value reads its
    name two tokens back; the query matches names) is found far sooner with one distractor
    than with five, and then holds with more."""

    def __init__(self, stages: list[tuple[int, int]], advance_at: float, max_steps: int) -> None:
        self.stages, self.advance_at, self.max_steps = stages, advance_at, max_steps
        self.stage, self.since, self.ema = 0, 0, 0.0

    @property
    def current(self) -> tuple[int, int]:
        return self.stages[self.stage]

    def sample(self, rng: random.Random) -> Problem:
        statements, deepest = self.current
        return make_problem(rng, rng.randint(1, deepest), statements)

    def update(self, step: int, ok: torch.Tensor) -> None:
        if self.stage == len(self.stages) - 1:
            return
        self.since += 1
        self.ema = 0.95 * self.ema + 0.05 * float(ok.float().mean())
        if self.ema >= self.advance_at or self.since >= self.max_steps:
            print(f"step {step + 1}: train accuracy {self.ema:.2f}, next stage "
                  f"(statements, deepest chain) = {self.stages[self.stage + 1]}", flush=True)
            self.stage, self.since, self.ema = self.stage + 1, 0, 0.0


def parse_stages(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split(":")) for part in text.split(",")]  # type: ignore[misc]


def train(args) -> OuroModel:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = parse_config(model_config(args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.loops))
    model = (load_model(args.init) if args.init else build_model(cfg, seed=args.seed)).to(args.device).train()
    if args.embed_mean and not args.init:
        # a direction every token shares: gives RoPE's q·k a content-free part, the seed of
        # positional heads (a statement's value reads its name two tokens back)
        g = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            model.model.embed_tokens.weight += args.embed_mean * torch.randn(cfg.hidden_size, generator=g).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.wd)
    val = chains.make_problems(args.seed + 1, 400)
    curriculum = Curriculum(parse_stages(args.stages), args.advance_at, args.stage_steps)
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        problems = [curriculum.sample(rng) for _ in range(args.batch)]
        ids, scored = encode(problems, args.device)
        loss, ce, ok = objective(model, ids, scored, args.beta, args.aux)
        curriculum.update(step, ok)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            ev = evaluate(model, val)
            model.train()
            print(f"step {step + 1} {time.time() - t0:.0f}s loss {loss.item():.3f} "
                  f"ce/loop {[round(c, 3) for c in ce.tolist()]} val acc/loop {ev['acc']} "
                  f"by depth (last loop) {ev['by_depth'][-1]} adaptive {ev['adaptive']}", flush=True)
    if args.gate_steps:
        for p in model.parameters():
            p.requires_grad_(False)
        gate = model.model.early_exit_gate
        for p in gate.parameters():
            p.requires_grad_(True)
        gopt = torch.optim.Adam(gate.parameters(), lr=args.gate_lr)
        for step in range(args.gate_steps):
            problems = [make_problem(rng, rng.randint(1, chains.MAX_DEPTH)) for _ in range(args.batch)]
            loss = gate_objective(model, *encode(problems, args.device), args.gate_k, args.gate_gamma)
            gopt.zero_grad(set_to_none=True)
            loss.backward()
            gopt.step()
            if (step + 1) % 100 == 0 or step + 1 == args.gate_steps:
                ev = evaluate(model, val)
                print(f"gate step {step + 1} {time.time() - t0:.0f}s loss {loss.item():.3f} adaptive {ev['adaptive']}",
                      flush=True)
        for p in model.parameters():
            p.requires_grad_(True)
    model.eval()
    ev = evaluate(model, val)
    print("final by depth per loop:", ev["by_depth"], "adaptive", ev["adaptive"], flush=True)
    print(f"trained in {time.time() - t0:.0f}s", flush=True)
    return model


def check_against_reference(out: Path, problems: list[Problem]) -> None:
    """The saved checkpoint, loaded by loopserve, gives the training forward's logits."""
    model = load_model(out)
    loops = model.max_loops
    for p in problems:
        ids = TOK.encode(p.prompt)
        ref, _ = dense_forward(model, ids, loops, loops, 1.0)
        with torch.no_grad():
            ours = loop_outputs(model, torch.tensor([ids]))[0][-1][0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--beta", type=float, default=0.05, help="entropy weight of the exit distribution")
    ap.add_argument("--aux", type=float, default=1.0, help="weight of the uniform per-loop CE")
    ap.add_argument("--stages", default=f"2:1,3:2,4:3,{chains.NUM_STATEMENTS}:{chains.MAX_DEPTH}",
                    help="curriculum: statements:deepest chain, comma-separated; the last is the task")
    ap.add_argument("--advance-at", type=float, default=0.9, help="train accuracy that ends a stage")
    ap.add_argument("--stage-steps", type=int, default=3000, help="most steps in a stage but the last")
    ap.add_argument("--gate-steps", type=int, default=1000, help="Ouro stage II: gate-only steps at the end")
    ap.add_argument("--gate-lr", type=float, default=1e-2)
    ap.add_argument("--gate-k", type=float, default=50.0, help="stage II: sharpness of the continue label")
    ap.add_argument("--gate-gamma", type=float, default=0.1, help="stage II: loss improvement worth a loop")
    ap.add_argument("--embed-mean", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--init", type=Path, default=None, help="continue from this checkpoint")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = train(args)
    if args.out:
        save_model(model.cpu(), args.out)
        check_against_reference(args.out, chains.make_problems(args.seed + 1, 8))
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
