"""The per-token exit rule shared by the engine and the dense reference."""

from __future__ import annotations

import torch


def exit_mask(depths: torch.Tensor, scores: torch.Tensor, min_loops: torch.Tensor,
              max_loops: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """True where a row that just ran loop `depth` exits: within [min, max] loops, on the
    score reaching the threshold; a threshold >= 1.0 means fixed depth (`max_loops`)."""
    early = (thresholds < 1.0) & (scores.float() >= thresholds)
    return (depths >= min_loops) & ((depths >= max_loops) | early)


def exit_without_score(depth: int, min_loops: int, max_loops: int, threshold: float) -> bool | None:
    """`exit_mask` for one row decided on the host, or None where only the score can decide."""
    if depth < min_loops:
        return False
    if depth >= max_loops:
        return True
    return False if threshold >= 1.0 else None
