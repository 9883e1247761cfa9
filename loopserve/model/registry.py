"""Build (random init from a seed), save and load models; safetensors with public key names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loopserve.model.base import LoopedModel
from loopserve.model.config import DoryConfig, HuginnConfig, OuroConfig, load_model_config
from loopserve.model.dory import DoryModel
from loopserve.model.huginn import HuginnModel
from loopserve.model.ouro import OuroModel

MODEL_CLASSES: dict[type, type[LoopedModel]] = {HuginnConfig: HuginnModel, OuroConfig: OuroModel,
                                                 DoryConfig: DoryModel}
# Trained checkpoints shipped as package data; each subdirectory's name is a model name.
CHECKPOINT_DIR = Path(__file__).resolve().parents[1] / "checkpoints"
# Buffers public checkpoints store that we recompute.
IGNORED_KEYS = {"freqs_cis"}


def _instantiate(cfg) -> LoopedModel:
    """The model with its parameters allocated on the CPU but not initialised: every one is
    written next (init_weights or a checkpoint), and torch's default init of each layer was most
    of a large model's build (18.6 of 33 s for ouro-1.4b-shape on the 2-core sandbox). Built on
    the meta device; a tied parameter stays one; a buffer computed from the config must name its
    device (it is kept as built)."""
    with torch.device("meta"):
        model = MODEL_CLASSES[type(cfg)](cfg)
    real: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in real:
                    real[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                module._parameters[name] = real[id(p)]
    if meta := [name for name, b in model.named_buffers() if b.is_meta]:
        raise RuntimeError(f"buffers {meta} were built on the meta device: give their factory device='cpu'")
    return model


@torch.no_grad()
def init_weights(model: LoopedModel, seed: int) -> None:
    """Seeded random init that keeps activations O(1): logits well spread (argmax ties
    improbable) and exit-gate probabilities mostly in 0.35..0.65 (mixed exit depths)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if isinstance(model, DoryModel) and _init_dory_scale(model, name, p, gen):
            continue
        if name.endswith("norm.weight") or "norm_" in name or "layernorm" in name or name.endswith("ln_f.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias") or name.endswith("qk_bias"):
            p.zero_()
        # normal_ in place: randn's values (randn is normal_ on a new tensor), no temporaries
        elif "early_exit_gate" in name:
            p.normal_(generator=gen).mul_(0.6 / math.sqrt(p.shape[-1]))
        elif p.dim() == 2 and ("wte" in name or "embed_tokens" in name):
            p.normal_(generator=gen)
        else:
            p.normal_(generator=gen).div_(math.sqrt(p.shape[-1]))
            if name.endswith("adapter.weight"):  # Huginn: a contractive recurrence, so the
                p[:, : p.shape[1] // 2] *= 0.2  # convergence exit fires at mixed depths


def _init_dory_scale(model: DoryModel, name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
    """Dory's learned scales (stored as multiples of initializer_range): near their HF
    init, with jitter, nGPT rates ~0.1..0.3 so every layer moves the state, logits O(1)."""
    ir, leaf = model.config.initializer_range, name.rsplit(".", 1)[-1]
    jitter = lambda lo, hi: lo + (hi - lo) * torch.rand(p.shape, generator=gen)  # noqa: E731
    if leaf in ("sqk", "s_gate"):
        p.copy_(ir * jitter(0.8, 1.2))
    elif leaf in ("lambda_1", "lambda_2"):
        p.copy_(ir / model.config.ngpt_alpha_init * jitter(0.1, 0.3))
    elif leaf in ("suv_gate", "suv_up"):
        p.copy_(jitter(0.8, 1.2))
    elif leaf == "logit_scale":
        p.copy_(ir * math.sqrt(model.config.hidden_size) * jitter(0.8, 1.2))
    else:
        return False
    return True


def build_model(cfg, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                seed: int = 0) -> LoopedModel:
    model = _instantiate(cfg)
    init_weights(model, seed)
    return model.to(device=device, dtype=dtype).eval()


def _checkpoint_tensors(model: LoopedModel) -> dict[str, torch.Tensor]:
    """state_dict without tied duplicates (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = v
    return out


def save_model(model: LoopedModel, directory: str | Path) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = model.config.model_dump(exclude_none=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    # clone: merged projections (layers.MergedLinear) leave weights as views of one tensor
    save_file({k: v.detach().cpu().clone() for k, v in _checkpoint_tensors(model).items()},
              str(d / "model.safetensors"))


def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        present = sorted(q.name for q in d.iterdir())
        raise ValueError(
            f"{d}: no weights: looked for model.safetensors.index.json and *.safetensors, found "
            f"{present[:10]}; for random weights name an embedded config (e.g. tiny-ouro) or "
            f"pass the config.json file itself")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(d / f)))
    return tensors


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LoopedModel:
    """Load an HF-format directory; a missing, unexpected or misshapen tensor is named."""
    d = Path(directory)
    cfg = load_model_config(d)
    model = _instantiate(cfg)
    tensors = _read_tensors(d)
    if hasattr(model, "rename_checkpoint"):  # checkpoint names -> state_dict names (Dory)
        tensors = model.rename_checkpoint(tensors)
    expected = _checkpoint_tensors(model)
    for name, param in expected.items():
        if name not in tensors:
            raise ValueError(f"{d}: checkpoint is missing tensor {name!r} (shape {tuple(param.shape)})")
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ValueError(
                f"{d}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                f"the config needs {tuple(param.shape)}"
            )
    extra = sorted(k for k in tensors if k not in expected and k.split(".")[-1] not in IGNORED_KEYS
                   and k not in model.state_dict())
    if extra:
        raise ValueError(f"{d}: checkpoint has tensors the config does not use: {extra[:5]}")
    model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False)
    return model.to(device=device, dtype=dtype).eval()


def resolve_model(name_or_dir: str | Path, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", seed: int = 0) -> LoopedModel:
    """A directory must hold weights (one without is refused: serving it would stream noise
    with exit 0), as does the name of a shipped checkpoint (CHECKPOINT_DIR/<name>); random init
    from `seed` is asked for explicitly, by an embedded config name or a config .json file."""
    p = Path(name_or_dir)
    if not p.is_dir() and (CHECKPOINT_DIR / str(name_or_dir)).is_dir():
        p = CHECKPOINT_DIR / str(name_or_dir)
    if p.is_dir():
        return load_model(p, dtype, device)
    return build_model(load_model_config(name_or_dir), dtype, device, seed)
