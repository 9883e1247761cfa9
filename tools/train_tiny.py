"""Train the shipped `tiny-ouro-chains` model: a small Ouro-style looped LM on chained
variable lookups (loopserve/checkpoints/chains.py), on CPU, seeded and reproducible.

    PYTHONPATH=. python tools/train_tiny.py --out loopserve/checkpoints/tiny-ouro-chains

(about 6 minutes on one shared CPU core). The shipped checkpoint is that run continued:

    PYTHONPATH=. python tools/train_tiny.py --out loopserve/checkpoints/tiny-ouro-chains \
        --init <first run> --seed 2 --steps 1200 --curriculum 1 --lr 2e-3

It has not learned the lookup yet (issue 30): accuracy stays near picking a prompt digit.

Ouro's objective: a cross-entropy at every loop t, weighted by the exit gate's distribution
p(t) = λ_t Π_{j<t}(1 − λ_j) (the last loop takes the remaining mass), minus β·H(p). The
engine exits once 1 − Π_{j≤t}(1 − λ_j) — the probability of having exited by loop t — reaches
`exit_threshold`, so the trained gate means what the engine reads. The forward is plain
PyTorch over the model's own parameters, batched; at the end it is checked against
loopserve's dense reference of the saved checkpoint.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from loopserve.checkpoints.chains import MAX_DEPTH, Problem, make_problem, make_problems
from loopserve.model.config import parse_config
from loopserve.model.dense_reference import dense_forward
from loopserve.model.ouro import OuroDecoderLayer, OuroModel
from loopserve.model.registry import build_model, load_model, save_model
from loopserve.model.tokenizer import ByteTokenizer

CONFIG = {
    "architectures": ["OuroForCausalLM"], "model_type": "ouro",
    "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "intermediate_size": 256, "vocab_size": 384, "max_position_embeddings": 512,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    "total_ut_steps": 4, "early_exit_threshold": 1.0,
}
TOK = ByteTokenizer()


def encode(problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] (prompt, answer, EOS, padding) and the mask of positions whose next token
    is scored (the answer's bytes and the EOS)."""
    rows = [TOK.encode(p.prompt) + TOK.encode(p.answer) + [TOK.eos_token_id] for p in problems]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), TOK.pad_token_id)
    scored = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for i, (p, row) in enumerate(zip(problems, rows)):
        ids[i, :len(row)] = torch.tensor(row)
        start = len(TOK.encode(p.prompt)) - 1
        scored[i, start:len(row) - 1] = True
    return ids, scored


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
    rot = model.rope(torch.arange(ids.shape[1]))
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
    lam = torch.sigmoid(torch.stack(gates[:-1]))
    stay = torch.cumprod(1 - lam, dim=0)
    before = torch.cat([torch.ones_like(stay[:1]), stay[:-1]])
    return torch.cat([lam * before, stay[-1:]])


def objective(model: OuroModel, ids: torch.Tensor, scored: torch.Tensor, beta: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_t p(t)·CE_t − β·H(p), averaged over scored positions; CE per loop [T])."""
    logits, gates = loop_outputs(model, ids[:, :-1])
    target = ids[:, 1:][scored]
    ce = torch.stack([F.cross_entropy(lg[scored], target, reduction="none") for lg in logits])
    p = exit_distribution([g[scored] for g in gates])
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(0)
    loss = ((p * ce).sum(0) - beta * entropy).mean()
    return loss, ce.detach().mean(1)


@torch.no_grad()
def accuracy_by_loop(model: OuroModel, problems: list[Problem]) -> list[float]:
    """Exact-match of the answer's first byte, greedy, at each fixed depth (teacher forced)."""
    ids, scored = encode(problems)
    logits, _ = loop_outputs(model, ids[:, :-1])
    first = scored.float().argmax(1)
    rows = torch.arange(len(problems))
    want = ids[rows, first + 1]
    return [float((lg[rows, first].argmax(-1) == want).float().mean()) for lg in logits]


@torch.no_grad()
def accuracy_by_depth(model: OuroModel, problems: list[Problem]) -> list[float]:
    ids, scored = encode(problems)
    logits, _ = loop_outputs(model, ids[:, :-1])
    first = scored.float().argmax(1)
    rows = torch.arange(len(problems))
    ok = logits[-1][rows, first].argmax(-1) == ids[rows, first + 1]
    depth = torch.tensor([p.depth for p in problems])
    return [round(float(ok[depth == d].float().mean()), 2) for d in range(1, MAX_DEPTH + 1)]


def train(out: Path, seed: int, steps: int, batch: int, lr: float, beta: float, curriculum: int,
          init: Path | None) -> None:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = (load_model(init) if init else build_model(parse_config(CONFIG), seed=seed)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    val = make_problems(seed + 1, 600)
    t0 = time.time()
    for step in range(1, steps + 1):
        top = min(MAX_DEPTH, 1 + step // curriculum)
        problems = [make_problem(rng, rng.randint(1, top)) for _ in range(batch)]
        loss, ce = objective(model, *encode(problems), beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps:
            model.eval()
            acc = accuracy_by_loop(model, val)
            model.train()
            print(f"step {step} {time.time() - t0:.0f}s loss {loss.item():.3f} "
                  f"ce/loop {[round(c, 3) for c in ce.tolist()]} val acc/loop {[round(a, 3) for a in acc]} by depth {accuracy_by_depth(model, val)}",
                  flush=True)
            save_model(model, out)  # a session may stop at any moment: keep the latest weights
    save_model(model.eval(), out)
    check_against_reference(out, val[:8])
    print(f"saved {out} after {time.time() - t0:.0f}s")


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
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--beta", type=float, default=0.05, help="entropy weight of the exit distribution")
    ap.add_argument("--init", type=Path, default=None, help="continue from this checkpoint (a second stage)")
    ap.add_argument("--curriculum", type=int, default=100, help="steps per added chain depth")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train(args.out, args.seed, args.steps, args.batch, args.lr, args.beta, args.curriculum, args.init)


if __name__ == "__main__":
    main()
