"""Values that cross processes and the fronts' contract: sampling parameters, outputs, the
handoff, worker events and load, error codes, edge limits, the prefix keyer.

Nothing here imports anything heavier than pydantic (no torch, no numpy), so the router and
both fronts carry these without loading an engine (`tests/test_protocol_light.py`).
"""
