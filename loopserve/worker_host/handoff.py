"""Sizing a handoff (kv_transfer's HandoffMessage) for placement decisions."""

from __future__ import annotations

from loopserve.kv_transfer.messages import HandoffMessage


def handoff_blocks(m: HandoffMessage) -> int:
    """Looped blocks a decode engine reserves for it: prompt + max_tokens on every plane."""
    tokens = len(m.prompt_token_ids) + int(m.params["max_tokens"])
    return -(-tokens // int(m.compat["block_size"])) * int(m.params["max_loops"])
