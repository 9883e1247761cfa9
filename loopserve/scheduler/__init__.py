"""The WorkKey scheduler (pure Python: never imports torch)."""

from loopserve.scheduler.batch import (
    BatchItem,
    BatchResult,
    ItemResult,
    QueueFullError,
    ScheduledBatch,
    SchedulerOutput,
    UpdateEvents,
)
from loopserve.scheduler.config import SchedulerConfig, SpecConfig
from loopserve.scheduler.request import SchedRequest
from loopserve.scheduler.scheduler import Scheduler
from loopserve.scheduler.types import Operation, RequestStatus, WorkKey

__all__ = [
    "BatchItem", "BatchResult", "ItemResult", "Operation", "QueueFullError", "RequestStatus",
    "ScheduledBatch", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedRequest",
    "SpecConfig", "UpdateEvents", "WorkKey",
]
