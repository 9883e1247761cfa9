"""Model configs with the public checkpoints' field names, validated on load.

Huginn-style configs use huginn-0125's `config.json` names (`RavenForCausalLM`), Ouro-style
configs Ouro-1.4B's (`OuroForCausalLM`), Dory-style configs transformers'
`DoryForCausalLM`. Hugging Face config.json files carry many more keys
than we use; those are ignored, but every field we use is checked (name, value, range).
loopserve adds three optional loop defaults: `min_loops`, `max_loops`, `exit_threshold`.
"""

from __future__ import annotations

import json
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

# Named model configs ship as package data (loopserve/model/configs/<name>.json), so every
# install finds them, not only a source checkout.
MODEL_CONFIGS = files("loopserve.model") / "configs"
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)
    architectures: list[str]
    min_loops: PosInt = 1
    exit_threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    def _check_heads_and_loops(self) -> None:
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.kv_heads})"
            )
        if self.max_loops is not None and self.max_loops < self.min_loops:
            raise ValueError(f"max_loops ({self.max_loops}) must be >= min_loops ({self.min_loops})")


class HuginnConfig(_Base):
    n_embd: PosInt
    num_attention_heads: PosInt = Field(validation_alias=AliasChoices("num_attention_heads", "n_heads"))
    num_key_value_heads: PosInt | None = None
    intermediate_size: PosInt
    vocab_size: PosInt
    padded_vocab_size: PosInt | None = None
    n_layers_in_prelude: NonNegInt
    n_layers_in_recurrent_block: PosInt
    n_layers_in_coda: NonNegInt
    mean_recurrence: PosInt
    max_loops: PosInt | None = None
    qk_bias: bool = False
    tie_embeddings: bool = True
    rope_base: Annotated[float, Field(gt=0)] = 50000.0
    block_size: PosInt = 4096  # max positions
    norm_eps: Annotated[float, Field(gt=0)] = 1e-6
    bias: bool = False
    init_values: dict[str, float] = Field(default_factory=lambda: {"std": 0.02, "embed_scale": 1.0})
    state_init: Literal["like-init", "zero"] = "like-init"

    @model_validator(mode="after")
    def _check(self) -> HuginnConfig:
        if self.n_embd % self.num_attention_heads:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        self._check_heads_and_loops()
        if self.qk_bias and self.kv_heads != self.num_attention_heads:
            raise ValueError("qk_bias requires num_key_value_heads == num_attention_heads")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size ({self.padded_vocab_size}) must be >= vocab_size ({self.vocab_size})"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.num_attention_heads

    @property
    def vocab(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    @property
    def loop_max(self) -> int:
        return self.max_loops or self.mean_recurrence


class OuroConfig(_Base):
    hidden_size: PosInt
    num_hidden_layers: PosInt
    num_attention_heads: PosInt
    num_key_value_heads: PosInt | None = None
    head_dim: PosInt | None = None
    intermediate_size: PosInt
    vocab_size: PosInt
    max_position_embeddings: PosInt = 65536
    rope_theta: Annotated[float, Field(gt=0)] = 1_000_000.0
    rms_norm_eps: Annotated[float, Field(gt=0)] = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: Literal["silu"] = "silu"
    total_ut_steps: PosInt = 4
    early_exit_threshold: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    max_loops: PosInt | None = None

    @model_validator(mode="after")
    def _check(self) -> OuroConfig:
        self._check_heads_and_loops()
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) when head_dim is not given"
            )
        return self

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def loop_max(self) -> int:
        return self.max_loops or self.total_ut_steps


class DoryConfig(_Base):
    """transformers' `DoryForCausalLM` config.json (nGPT-style looped model).

    `DoryConfig.to_dict()` writes `layer_types` interleaved with "mlp" entries and the layer
    counts doubled; that form is undone here the way `DoryConfig.__post_init__` does.
    """

    vocab_size: PosInt
    hidden_size: PosInt
    intermediate_size: PosInt
    num_hidden_layers: PosInt
    num_attention_heads: PosInt
    num_key_value_heads: PosInt
    head_dim: PosInt
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: PosInt = 8192
    initializer_range: Annotated[float, Field(gt=0)] = 0.0177
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, dict] = Field(default_factory=dict)
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: PosInt = 1024
    layer_types: list[Literal["full_attention", "sliding_attention"]]
    ngpt_alpha_init: float = 0.05
    n_input_layers: NonNegInt = 8
    n_recurrent_layers: PosInt
    n_output_layers: NonNegInt = 8
    n_recurrent_loops: PosInt = 2
    recurrent_kv_cache_mode: Literal["per_loop", "last_loop"] = "per_loop"
    max_loops: PosInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _undouble(cls, data):
        if not isinstance(data, dict):
            return data
        d = dict(data)
        types = d.get("layer_types")
        if isinstance(types, list) and "mlp" in types:
            d["layer_types"] = types[::2]
            for key in ("num_hidden_layers", "n_input_layers", "n_output_layers", "n_recurrent_layers"):
                if isinstance(d.get(key), int):
                    d[key] //= 2
        n = d.get("num_hidden_layers")
        if d.get("layer_types") is None and isinstance(n, int):
            d["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]
        if d.get("n_recurrent_layers") is None and isinstance(n, int):
            d["n_recurrent_layers"] = n - d.get("n_input_layers", 8) - d.get("n_output_layers", 8)
        if not d.get("rope_parameters") and isinstance(d.get("layer_types"), list):
            thetas = {"sliding_attention": 10_000.0, "full_attention": 10_000_000.0}
            d["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": thetas[t]}
                                    for t in set(d["layer_types"]) if t in thetas}
        return d

    @model_validator(mode="after")
    def _check(self) -> DoryConfig:
        if self.n_input_layers + self.n_recurrent_layers + self.n_output_layers != self.num_hidden_layers:
            raise ValueError(
                f"n_input_layers ({self.n_input_layers}) + n_recurrent_layers ({self.n_recurrent_layers}) + "
                f"n_output_layers ({self.n_output_layers}) must equal num_hidden_layers ({self.num_hidden_layers})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for t in set(self.layer_types):
            rp = self.rope_parameters.get(t)
            if not isinstance(rp, dict) or "rope_theta" not in rp:
                raise ValueError(f"rope_parameters[{t!r}] must give rope_theta, got {rp!r}")
            if rp.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters[{t!r}].rope_type={rp['rope_type']!r}: only 'default' is supported")
        if self.max_loops is not None and not self.min_loops <= self.max_loops <= self.n_recurrent_loops:
            raise ValueError(
                f"max_loops ({self.max_loops}) must be in min_loops ({self.min_loops})..n_recurrent_loops "
                f"({self.n_recurrent_loops})"
            )
        if self.min_loops > self.n_recurrent_loops:
            raise ValueError(f"min_loops ({self.min_loops}) must be <= n_recurrent_loops ({self.n_recurrent_loops})")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def loop_max(self) -> int:
        return self.max_loops or self.n_recurrent_loops

    def rope_theta(self, layer_type: str) -> float:
        return float(self.rope_parameters[layer_type]["rope_theta"])


CONFIG_CLASSES: dict[str, type[_Base]] = {
    "RavenForCausalLM": HuginnConfig,
    "OuroForCausalLM": OuroConfig,
    "DoryForCausalLM": DoryConfig,
}


def parse_config(data: dict, source: str = "config") -> _Base:
    """Validate a config dict; errors name the field, the value and the rule."""
    archs = data.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ValueError(f"{source}: 'architectures' must be a non-empty list, got {archs!r}")
    cls = CONFIG_CLASSES.get(archs[0])
    if cls is None:
        raise ValueError(
            f"{source}: unsupported architecture {archs[0]!r}; supported: {sorted(CONFIG_CLASSES)}"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            field = ".".join(str(x) for x in err["loc"]) or "config"
            value = data.get(err["loc"][0]) if err["loc"] else None
            parts.append(f"{field}={value!r}: {err['msg']}")
        raise ValueError(f"{source}: invalid {cls.__name__}: " + "; ".join(parts)) from None


def load_model_config(name_or_dir: str | Path) -> _Base:
    """A directory resolves to its config.json, a .json file to itself, a name to
    MODEL_CONFIGS/<name>.json."""
    p = Path(name_or_dir)
    path: Path | Traversable
    if p.is_dir():
        path = p / "config.json"
    elif p.suffix == ".json" and p.exists():
        path = p
    else:
        path = MODEL_CONFIGS / f"{name_or_dir}.json"
        if not path.is_file():
            known = sorted(q.name.removesuffix(".json") for q in MODEL_CONFIGS.iterdir() if q.name.endswith(".json"))
            raise ValueError(f"model {str(name_or_dir)!r} is neither a directory nor one of {known}")
    return parse_config(json.loads(path.read_text()), str(path))
