"""Edge limits: caps on a request that both fronts check before any worker sees it.

They bound what one request can cost the server (memory, Ray transfer, stop-string matching)
whatever the model. The model's own limits (max_model_len, the vocabulary, loop bounds) are
the engine's to check: its ValueError reaches the caller as INVALID_ARGUMENT all the same.
Every message names the field, the limit's config key and both values.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.status import FieldError


class RequestLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # grpc's max_receive_message_length: larger messages get RESOURCE_EXHAUSTED from grpc itself
    max_message_bytes: int = Field(4 << 20, ge=1024)
    max_request_id_bytes: int = Field(256, ge=1)
    max_prompt_bytes: int = Field(1 << 20, ge=1)  # a text prompt, UTF-8
    max_stop: int = Field(16, ge=0)  # stop strings per request
    max_stop_bytes: int = Field(256, ge=1)  # one stop string, UTF-8
    max_stop_token_ids: int = Field(64, ge=0)
    # HTTP: prompts × n of one API request, each a request on the engines
    max_choices: int = Field(128, ge=1)


def check_limits(request_id: str, prompt: str | list[int], params: SamplingParams,
                 limits: RequestLimits) -> None:
    """Raise FieldError naming the first field over its limit (as the gRPC request spells it)."""
    _at_most("request_id", len(request_id.encode()), "bytes", limits.max_request_id_bytes,
             "max_request_id_bytes")
    if isinstance(prompt, str):
        _at_most("prompt.text", len(prompt.encode()), "bytes", limits.max_prompt_bytes,
                 "max_prompt_bytes")
    _at_most("sampling.stop", len(params.stop), "strings", limits.max_stop, "max_stop")
    for i, stop in enumerate(params.stop):
        _at_most(f"sampling.stop[{i}]", len(stop.encode()), "bytes", limits.max_stop_bytes,
                 "max_stop_bytes")
    _at_most("sampling.stop_token_ids", len(params.stop_token_ids), "ids", limits.max_stop_token_ids,
             "max_stop_token_ids")


def _at_most(field: str, got: int, unit: str, limit: int, key: str) -> None:
    if got > limit:
        raise FieldError(field, f"has {got} {unit}, more than server.limits.{key} ({limit})")
