"""Real NIXL (UCX over loopback) between two processes reading paged KV blocks."""

import multiprocessing as mp
import time

import pytest
import torch

from loopserve.kv_transfer.connector import ReceiveTracker, TransferLedger
from loopserve.kv_transfer.nixl_agent import KVCompatError, NixlKVWorker

SHAPE = dict(looped=(64, 3, 2, 4, 2, 8), flat=(16, 2, 2, 4, 2, 8))
COMPAT = {"model": "tiny", "dtype": "float32", "num_looped_layers": 3}


def pools(seed, shapes=SHAPE, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}


def owner(conn, shapes, block_size):
    """The prefill side: holds data, answers handshake, reports notifications."""
    w = NixlKVWorker("prefill-0", pools(1, shapes), block_size, COMPAT)
    conn.send(w.handshake_info())
    got = {"read": [], "release": [], "renew": []}
    deadline = time.time() + 30
    while time.time() < deadline and not conn.poll():
        for k, v in w.poll_notifications().items():
            got[k] += v
        time.sleep(0.01)
    conn.recv()
    for k, v in w.poll_notifications().items():
        got[k] += v
    conn.send(got)
    w.close()


@pytest.fixture(scope="module")
def peer():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=owner, args=(b, SHAPE, 4), daemon=True)
    proc.start()
    info = a.recv()
    yield info, a
    proc.join(timeout=30)


def test_read_blocks_of_every_plane_bitwise(peer):
    info, conn = peer
    reader = NixlKVWorker("decode-0", {k: torch.zeros(s) for k, s in SHAPE.items()}, 4, COMPAT)
    reader.add_peer(info)
    src = pools(1)
    # 10 tokens -> 3 blocks per plane; remote ids mix contiguous runs and gaps
    remote = {"flat": [3, 4, 9], "depth": [[0, 1, 2], [10, 30, 31], [7, 8, 50]]}
    local = {"flat": [0, 5, 6], "depth": [[40, 41, 42], [1, 2, 3], [60, 11, 12]]}
    nbytes = reader.start_read("req-1", "prefill-0", remote, local, num_tokens=10)
    assert nbytes == (9 * src["looped"][0].numel() + 3 * src["flat"][0].numel()) * 4
    for _ in range(3000):
        done, failed = reader.poll()
        if done or failed:
            break
        time.sleep(0.005)
    assert done == ["req-1"] and not failed
    for pr, pl in zip(remote["depth"], local["depth"]):
        assert torch.equal(reader.pools["looped"][pl], src["looped"][pr])
    assert torch.equal(reader.pools["flat"][local["flat"]], src["flat"][remote["flat"]])
    untouched = [b for b in range(64) if b not in sum(local["depth"], [])]
    assert reader.pools["looped"][untouched].abs().sum() == 0
    reader.notify("prefill-0", "release", ["req-2"])
    reader.notify("prefill-0", "renew", ["req-3", "req-4"])
    time.sleep(0.5)
    conn.send("stop")
    got = conn.recv()
    assert got["read"] == ["req-1"] and got["release"] == ["req-2"] and got["renew"] == ["req-3", "req-4"]
    reader.close()


@pytest.mark.parametrize("change,field", [
    ({"block_size": 8}, "block_size"),
    ({"dtype": "bfloat16"}, "dtype"),
    ({"num_looped_layers": 4}, "num_looped_layers"),
])
def test_handshake_refuses_mismatch_naming_both_values(change, field):
    a = NixlKVWorker("p-compat", pools(2), 4, COMPAT)
    info = a.handshake_info()
    compat = {**COMPAT, **{k: v for k, v in change.items() if k != "block_size"}}
    b = NixlKVWorker("d-compat", pools(3), change.get("block_size", 4), compat)
    with pytest.raises(KVCompatError, match=field) as e:
        b.add_peer(info)
    assert repr(info["compat"][field]) in str(e.value) and repr(b.compat[field]) in str(e.value)
    a.close()
    b.close()


def test_block_bytes_mismatch_refused():
    a = NixlKVWorker("p-bytes", pools(2), 4, COMPAT)
    shapes = dict(SHAPE, looped=(64, 3, 2, 4, 2, 16))
    b = NixlKVWorker("d-bytes", pools(3, shapes), 4, COMPAT)
    with pytest.raises(KVCompatError, match="block bytes"):
        b.add_peer(a.handshake_info())


def test_read_from_unknown_peer_is_a_clear_error():
    w = NixlKVWorker("lonely", pools(4), 4, COMPAT)
    with pytest.raises(KeyError, match="unknown peer engine 'nobody'"):
        w.start_read("r", "nobody", {"flat": [0], "depth": [[0]]}, {"flat": [0], "depth": [[0]]}, 1)
    w.close()


def test_lease_renewed_never_expires_and_unrenewed_does():
    led = TransferLedger(lease_s=1.0)
    led.add("a", 0.0)
    led.add("b", 0.0)
    expired = []
    for t in range(1, 10):  # a reader renews "a" every 0.5 s, nobody renews "b"
        led.renew(["a"], t * 0.5)
        expired += led.expired(t * 0.5)
    assert expired == ["b"] and "a" in led
    assert led.expired(5.4) == [] and led.expired(5.5) == ["a"]
    tr = ReceiveTracker(timeout_s=2.0)
    tr.start("x", 0.0)
    assert tr.expired(1.0) == [] and tr.expired(2.0) == ["x"] and not tr.done("x")
