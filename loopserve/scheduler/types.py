"""The three vocabularies of the WorkKey scheduler (pure Python, no torch).

RequestStatus is lifecycle only; WorkKey is the one piece of pending work a request may have;
Operation is the model-call boundary every scheduled batch is bound to.
"""

from __future__ import annotations

from enum import Enum


class RequestStatus(str, Enum):
    WAITING = "WAITING"  # queued for admission (or preempted, waiting to resume)
    RECEIVING = "RECEIVING"  # decode side of PD: blocks allocated, KV still in flight, no slot
    TRANSFERRING = "TRANSFERRING"  # prefill side of PD: done, blocks held until the reader confirms
    ACTIVE = "ACTIVE"  # holds an admission slot and may be scheduled
    FINISHED = "FINISHED"


class Operation(str, Enum):
    PRELUDE = "PRELUDE"
    RECURRENT = "RECURRENT"
    CODA = "CODA"


class WorkKey(str, Enum):
    PROMPT_ATOMIC = "PROMPT_ATOMIC"  # whole prompt, all phases, one work item
    PROMPT_PRELUDE = "PROMPT_PRELUDE"  # split prefill: a chunk's prelude
    PROMPT_RECURRENT = "PROMPT_RECURRENT"  # split prefill: one loop of a chunk
    DECODE_PRELUDE = "DECODE_PRELUDE"
    DECODE_RECURRENT = "DECODE_RECURRENT"
    DECODE_CODA = "DECODE_CODA"  # coda of pending tokens (decode token or a finished chunk)
    SPECULATIVE = "SPECULATIVE"  # a self-speculation round (draft shallow, verify deep)


# Work keys whose Operation is fixed; PROMPT_ATOMIC and SPECULATIVE carry a phase instead.
FIXED_OPERATION: dict[WorkKey, Operation] = {
    WorkKey.PROMPT_PRELUDE: Operation.PRELUDE,
    WorkKey.PROMPT_RECURRENT: Operation.RECURRENT,
    WorkKey.DECODE_PRELUDE: Operation.PRELUDE,
    WorkKey.DECODE_RECURRENT: Operation.RECURRENT,
    WorkKey.DECODE_CODA: Operation.CODA,
}
