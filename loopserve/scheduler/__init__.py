"""The WorkKey scheduler (pure Python: never imports torch)."""

from loopserve.scheduler.batch import (
    BatchItem,
    BatchResult,
    ItemResult,
    ScheduledBatch,
    SchedulerOutput,
    UpdateEvents,
)
from loopserve.scheduler.config import SchedulerConfig, SpeculativeConfig
from loopserve.scheduler.errors import DuplicateSelectionError
from loopserve.scheduler.request import RequestState, SchedRequest
from loopserve.scheduler.scheduler import Scheduler
from loopserve.scheduler.types import Operation, RequestStatus, WorkKey

__all__ = [
    "BatchItem", "BatchResult", "DuplicateSelectionError", "ItemResult", "Operation",
    "RequestState", "RequestStatus", "ScheduledBatch", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "SchedRequest", "SpeculativeConfig", "UpdateEvents", "WorkKey",
]
