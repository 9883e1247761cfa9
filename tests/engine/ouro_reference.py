"""Ouro's published forward pass in plain PyTorch, sharing no code with loopserve: the
independent check of loopserve's Ouro family (transformers has no Ouro class; Ouro checkpoints
ship `modeling_ouro.py` as remote code, which this re-states from its definition).

It reads a checkpoint directory (`config.json` + `*.safetensors`) by Ouro's tensor names and
runs every position through `total_ut_steps` loops. One loop: each decoder layer with
sandwich norms (x + input_layernorm_2(attn(input_layernorm(x))), then
x + post_attention_layernorm_2(mlp(post_attention_layernorm(x)))), attention causal over the
same loop's keys and values (Ouro's cache has one slot per loop and layer), then the final
`norm`. The normed hidden state is the next loop's input and gives the loop's logits
(`lm_head`) and exit gate λ = σ(early_exit_gate(h)); the probability of having exited after
loop t is 1 − Π_{s≤t}(1 − λ_s), and the last loop takes the rest (`OuroForCausalLM`'s
`exit_threshold`: the first loop whose cumulative exit probability reaches the threshold).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


class OuroReference:
    def __init__(self, directory: str | Path) -> None:
        d = Path(directory)
        self.cfg = json.loads((d / "config.json").read_text())
        if self.cfg.get("use_sliding_window") or "sliding_attention" in self.cfg.get("layer_types", ()):
            raise ValueError("the reference has full attention only")
        self.w: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            self.w.update({k: v.float() for k, v in load_file(str(f)).items()})
        self.heads = self.cfg["num_attention_heads"]
        self.kv_heads = self.cfg.get("num_key_value_heads", self.heads)
        self.head_dim = self.cfg.get("head_dim", self.cfg["hidden_size"] // self.heads)
        self.loops = self.cfg.get("total_ut_steps", 4)
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"])
        return self.w[f"{name}.weight"] * x

    def _rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.head_dim
        inv_freq = 1.0 / (self.cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(n).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout
        return emb.cos(), emb.sin()

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    def _attention(self, x: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        q = (x @ self.w[f"{p}.q_proj.weight"].T).view(n, self.heads, hd)
        k = (x @ self.w[f"{p}.k_proj.weight"].T).view(n, self.kv_heads, hd)
        v = (x @ self.w[f"{p}.v_proj.weight"].T).view(n, self.kv_heads, hd)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        group = self.heads // self.kv_heads  # query head h reads key/value head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ self.w[f"{p}.o_proj.weight"].T

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        gate = torch.nn.functional.silu(x @ self.w[f"{p}.gate_proj.weight"].T)
        return (gate * (x @ self.w[f"{p}.up_proj.weight"].T)) @ self.w[f"{p}.down_proj.weight"].T

    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [loops, N, V] after each loop, exit CDF [loops, N])."""
        h = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        cos, sin = self._rope(len(ids))
        logits, cdf = [], []
        remaining = torch.ones(len(ids))
        for t in range(self.loops):
            for i in range(self.cfg["num_hidden_layers"]):
                p = f"model.layers.{i}"
                a = self._attention(self._norm(h, f"{p}.input_layernorm"), f"{p}.self_attn", cos, sin)
                h = h + self._norm(a, f"{p}.input_layernorm_2")
                m = self._mlp(self._norm(h, f"{p}.post_attention_layernorm"), f"{p}.mlp")
                h = h + self._norm(m, f"{p}.post_attention_layernorm_2")
            h = self._norm(h, "model.norm")
            logits.append(h @ self.lm_head.T)
            gate = torch.sigmoid(h @ self.w["model.early_exit_gate.weight"].T + self.w["model.early_exit_gate.bias"])
            remaining = remaining * (1 - gate.squeeze(-1)) if t < self.loops - 1 else torch.zeros_like(remaining)
            cdf.append(1 - remaining)
        return torch.stack(logits), torch.stack(cdf)

    def exit_loop(self, cdf: torch.Tensor, threshold: float) -> torch.Tensor:
        """Per position, the loop (1-based) it exits at: the first whose CDF reaches `threshold`."""
        return (cdf >= threshold).float().argmax(0) + 1

    def greedy(self, prompt: list[int], max_tokens: int, loops: int) -> list[int]:
        """Greedy tokens at a fixed depth of `loops`, recomputing everything per token."""
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(self.forward(ids)[0][loops - 1, -1].argmax()))
        return ids[len(prompt):]
