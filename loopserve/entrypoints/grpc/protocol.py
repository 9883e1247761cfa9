"""Conversions between the gRPC messages (protos/loopserve.proto) and engine types.

Kept apart from the server so the client, the server and tests share one mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from loopserve.entrypoints.grpc.proto import loopserve_pb2 as pb
from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.sampling_params import SamplingParams

_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs")
_OPTIONAL_LOOPS = ("min_loops", "max_loops", "exit_threshold")
_FLOAT32 = ("temperature", "top_p", "exit_threshold")
M = TypeVar("M", bound=Message)


def parse(cls: type[M], raw: bytes) -> M:
    """A request message from the wire; ValueError if the bytes are not one.

    Protobuf parsing rejects truncated messages and strings that are not UTF-8 (DecodeError),
    but keeps a known field sent with the wrong wire type as an unknown field, silently
    defaulting it: that is refused here too, naming the field. Unknown field numbers pass
    (newer clients may send fields this server does not know).
    """
    try:
        msg = cls.FromString(raw)
    except DecodeError as e:
        raise ValueError(f"request is not a valid {cls.DESCRIPTOR.name}: {e}") from None
    _check_wire_types(msg, cls.DESCRIPTOR.name, "")
    return msg


def _check_wire_types(msg: Message, name: str, where: str) -> None:
    fields = msg.DESCRIPTOR.fields_by_number
    for f in UnknownFieldSet(msg):
        if f.field_number in fields:
            raise ValueError(f"request is not a valid {name}: field "
                             f"{where}{fields[f.field_number].name} has the wrong wire type")
    for field, value in msg.ListFields():
        if isinstance(value, Message):
            _check_wire_types(value, name, f"{where}{field.name}.")


def request_from_proto(req: pb.GenerateRequest) -> tuple[str | list[int], SamplingParams]:
    """The prompt and validated SamplingParams; ValueError names the bad field."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise ValueError("prompt must be set (text or token_ids)")
    prompt: str | list[int] = req.text if which == "text" else list(req.token_ids.ids)
    if not prompt:
        raise ValueError(f"prompt.{which} must not be empty")
    s, lp = req.sampling, req.loops
    kw = {k: getattr(s, k) for k in _OPTIONAL_SAMPLING if s.HasField(k)}
    kw.update({k: getattr(lp, k) for k in _OPTIONAL_LOOPS if lp.HasField(k)})
    for k in _FLOAT32:  # float32 on the wire: 0.7 arrives as 0.699999988; 7 digits is all it holds
        if k in kw:
            kw[k] = float(f"{kw[k]:.7g}")
    return prompt, SamplingParams(stop_token_ids=tuple(s.stop_token_ids), stop=tuple(s.stop),
                                  ignore_eos=s.ignore_eos, priority=req.priority, **kw)


def request_to_proto(prompt: str | list[int], params: SamplingParams,
                     request_id: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        stop_token_ids=list(params.stop_token_ids), stop=list(params.stop), ignore_eos=params.ignore_eos,
        **{k: getattr(params, k) for k in _OPTIONAL_SAMPLING if getattr(params, k) is not None})
    loops = pb.LoopParams(**{k: getattr(params, k) for k in _OPTIONAL_LOOPS if getattr(params, k) is not None})
    req = pb.GenerateRequest(request_id=request_id, sampling=sampling, loops=loops, priority=params.priority)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def responses_from_output(out: RequestOutput, client_id: str, now: float) -> list[pb.GenerateResponse]:
    """A Chunk for new tokens/text, then a Complete (or an Error) when the request finished."""
    msgs = []
    if out.new_token_ids or out.text_delta:
        msgs.append(pb.GenerateResponse(request_id=client_id, chunk=pb.Chunk(
            token_ids=list(out.new_token_ids), text=out.text_delta,
            exit_depths=list(out.exit_depths), logprobs=list(out.logprobs or ()))))
    if out.finished:
        if out.error is not None and out.finish_reason == "error":
            msgs.append(pb.GenerateResponse(request_id=client_id,
                                            error=pb.Error(message=out.error, code=out.error_code or "INTERNAL")))
        else:
            ttft = out.first_token_time - out.arrival_time if out.first_token_time else 0.0
            msgs.append(pb.GenerateResponse(request_id=client_id, complete=pb.Complete(
                finish_reason=out.finish_reason or "", prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens, ttft_s=ttft,
                e2e_s=now - out.arrival_time if out.arrival_time else 0.0)))
    return msgs


@dataclass(frozen=True)
class StreamEvent:
    """One GenerateResponse as the client sees it."""

    kind: str  # "chunk" | "complete" | "error"
    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    exit_depths: tuple[int, ...] = ()
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None


def event_from_response(r: pb.GenerateResponse) -> StreamEvent:
    kind = r.WhichOneof("response")
    if kind == "chunk":
        c = r.chunk
        return StreamEvent("chunk", r.request_id, tuple(c.token_ids), c.text, tuple(c.exit_depths))
    if kind == "complete":
        return StreamEvent("complete", r.request_id, finish_reason=r.complete.finish_reason,
                           completion_tokens=r.complete.completion_tokens)
    return StreamEvent("error", r.request_id, error=f"{r.error.code}: {r.error.message}")
