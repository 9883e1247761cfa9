"""Real NIXL (UCX over loopback) between two processes reading paged KV blocks.

The owner (prefill side) runs in a spawned process (tests/kv_transfer/owner.py); the reader
(decode side) is this process. Data is checked bitwise against the owner's seeded pools.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time

import pytest
import torch

from loopserve.intmath import cdiv
from loopserve.kv_transfer.connector import KVCompatError
from loopserve.kv_transfer.nixl_agent import (
    KVTransferError,
    NixlKVWorker,
    NixlUnavailableError,
    UnknownPeerError,
)
from tests.kv_transfer.owner import BLOCK_SIZE, COMPAT, DTYPE, SHAPES, make_pools, serve

OWNER = "prefill-0"
SENTINEL = -7.0  # what the reader's blocks hold before a READ lands
MAX_IDLE_POLLS = 20_000  # polls in a row without a READ finishing before wait_reads gives up


def wait_reads(worker: NixlKVWorker, request_ids: list[str],
               max_idle_polls: int = MAX_IDLE_POLLS) -> tuple[list[str], list[str]]:
    """Poll until every id in request_ids is done or failed, or `max_idle_polls` polls in a
    row changed nothing (a bound by progress, not by the clock of a busy machine)."""
    want, done, failed = set(request_ids), [], []
    idle = 0
    while want - set(done) - set(failed) and idle < max_idle_polls:
        d, f = worker.poll()
        done += d
        failed += f
        idle = 0 if d or f else idle + 1
        time.sleep(0.0005)  # let NIXL's progress thread run on a busy machine
    return done, failed


class Owner:
    """Handle on the owner process; `seed` says what its pools hold right now."""

    def __init__(self, device: str = "cpu") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.seed, self.device = 1, device
        self.proc = ctx.Process(target=serve, args=(child, OWNER, self.seed, device), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise TimeoutError("owner process did not start")
        self.info = self.conn.recv()

    def data(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in make_pools(self.seed).items()}

    def notes(self, count: int, max_idle_polls: int = 5_000) -> dict[str, list[str]]:
        self.conn.send(("notes", count, max_idle_polls))
        return self.conn.recv()

    def restart(self, seed: int) -> None:
        self.conn.send(("restart", seed))
        self.info, self.seed = self.conn.recv(), seed

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.conn.recv()
        self.proc.join(timeout=30)


def reader_pools(device: str = "cpu") -> dict[str, torch.Tensor]:
    return {k: torch.full(s, SENTINEL, dtype=DTYPE, device=device) for k, s in SHAPES.items()}


@pytest.fixture(scope="module")
def owner():
    o = Owner()
    yield o
    o.stop()


@pytest.fixture(scope="module")
def reader(owner):
    w = NixlKVWorker("decode-0", reader_pools(), BLOCK_SIZE, COMPAT, capture_telemetry=True)
    w.add_peer(owner.info)
    yield w
    w.close()


def pick_ids(rng: random.Random, free: list[int], n: int) -> list[int]:
    """n distinct ids taken from `free`, as runs of 1..5 consecutive ids where they are free."""
    out: list[int] = []
    while len(out) < n:
        b, stop = rng.choice(free), rng.randint(1, 5)
        while b in free and stop and len(out) < n:
            free.remove(b)
            out.append(b)
            b, stop = b + 1, stop - 1
    return out


def random_tables(rng: random.Random, n_blocks: int, remote_free: dict, local_free: dict):
    """Remote and local tables (flat + 3 depth planes) of n_blocks each."""
    def table(free):
        return {"flat": pick_ids(rng, free["flat"], n_blocks),
                "depth": [pick_ids(rng, free["looped"], n_blocks) for _ in range(3)]}
    return table(remote_free), table(local_free)


def block_pairs(remote: dict, local: dict, n: int):
    """(pool, local id, remote id) of every block the READ covers."""
    planes = [("flat", local["flat"], remote["flat"])]
    planes += [("looped", lo, re) for lo, re in zip(local["depth"], remote["depth"])]
    return [(pool, lo, re) for pool, los, res in planes for lo, re in zip(los[:n], res[:n])]


def expected_descriptors(remote: dict, local: dict, n: int) -> int:
    """Blocks of one pool sorted by local id form one descriptor while both ids advance by one."""
    pairs = sorted(block_pairs(remote, local, n))
    return sum(1 for i, (pool, lo, re) in enumerate(pairs) if i == 0 or pairs[i - 1] != (pool, lo - 1, re - 1))


def block_bytes(pool: str) -> int:
    return torch.empty(SHAPES[pool][1:], dtype=DTYPE).nbytes


def test_concurrent_random_reads_land_bitwise_and_notify_the_owner(owner, reader):
    rng = random.Random(0)
    remote_free = {k: list(range(s[0])) for k, s in SHAPES.items()}
    local_free = {k: list(range(s[0])) for k, s in SHAPES.items()}
    reqs = {}
    for i, num_tokens in enumerate([1, 37, 80, 129]):  # 1, 3, 5, 9 blocks per plane
        n = cdiv(num_tokens, BLOCK_SIZE)
        remote, local = random_tables(rng, n + rng.randint(0, 2), remote_free, local_free)  # tables may be longer
        rid = f"req,{i}"  # ids are opaque strings: commas must survive the notification
        nbytes = reader.start_read(rid, OWNER, remote, local, num_tokens)
        assert nbytes == n * (3 * block_bytes("looped") + block_bytes("flat"))
        reqs[rid] = (remote, local, n, nbytes)
    done, failed = wait_reads(reader, list(reqs))
    assert sorted(done) == sorted(reqs) and failed == []

    src, dst = owner.data(), reader.pools
    written = {"looped": set(), "flat": set()}
    for rid, (remote, local, n, nbytes) in reqs.items():
        for pool, lo, re in block_pairs(remote, local, n):
            assert torch.equal(dst[pool][lo].view(torch.int16), src[pool][re].view(torch.int16)), (rid, pool, lo)
            written[pool].add(lo)
        stats = reader.read_stats.pop(rid)
        assert stats.bytes == nbytes
        assert stats.descriptors == expected_descriptors(remote, local, n), rid
    for pool, ids in written.items():  # nothing outside the tables' first n blocks was touched
        untouched = [b for b in range(SHAPES[pool][0]) if b not in ids]
        assert bool((dst[pool][untouched] == SENTINEL).all()), pool
        dst[pool].fill_(SENTINEL)

    notes = owner.notes(count=len(reqs))
    assert sorted(notes["read"]) == sorted(reqs) and notes["release"] == notes["renew"] == []


def test_read_from_a_first_block_leaves_the_cached_prefix_alone(owner, reader):
    """The decode side's prefix cache holds the first blocks: only the rest move."""
    remote = {"flat": [4, 5, 6, 7], "depth": [[8, 9, 10, 11], [0, 1, 2, 3], [12, 13, 14, 15]]}
    local = {"flat": [20, 21, 22, 23], "depth": [[30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52, 53]]}
    nbytes = reader.start_read("tail", OWNER, remote, local, 4 * BLOCK_SIZE, first_block=3)
    assert nbytes == 3 * block_bytes("looped") + block_bytes("flat")
    assert wait_reads(reader, ["tail"]) == (["tail"], [])
    src, dst = owner.data(), reader.pools
    for pool, lo, re in block_pairs(remote, local, 4):
        same = torch.equal(dst[pool][lo].view(torch.int16), src[pool][re].view(torch.int16))
        assert same == (lo % 10 == 3), (pool, lo)
    assert owner.notes(count=1)["read"] == ["tail"]
    with pytest.raises(ValueError, match="first_block"):
        reader.start_read("all-cached", OWNER, remote, local, 4 * BLOCK_SIZE, first_block=4)
    for t in reader.pools.values():
        t.fill_(SENTINEL)


def test_contiguous_runs_move_as_one_descriptor_per_pool(owner, reader):
    # The planes are listed out of address order: the merge must not depend on table order.
    remote = {"flat": [4, 5, 6, 7], "depth": [[8, 9, 10, 11], [0, 1, 2, 3], [4, 5, 6, 7]]}
    local = {"flat": [20, 21, 22, 23], "depth": [[58, 59, 60, 61], [50, 51, 52, 53], [54, 55, 56, 57]]}
    reader.start_read("contig", OWNER, remote, local, 4 * BLOCK_SIZE)
    assert wait_reads(reader, ["contig"]) == (["contig"], [])
    assert reader.read_stats.pop("contig").descriptors == 2  # looped 12 blocks + flat 4 blocks
    src = owner.data()
    assert torch.equal(reader.pools["looped"][50:62], src["looped"][0:12])
    assert torch.equal(reader.pools["flat"][20:24], src["flat"][4:8])
    assert owner.notes(count=1)["read"] == ["contig"]
    for t in reader.pools.values():
        t.fill_(SENTINEL)


def test_release_and_renew_notifications_reach_the_owner(owner, reader):
    assert reader.notify(OWNER, "release", ["r,1"])
    assert reader.notify(OWNER, "renew", ["r2", "r 3"])
    notes = owner.notes(count=3)
    assert notes == {"read": [], "release": ["r,1"], "renew": ["r2", "r 3"]}
    assert reader.notify("nobody", "renew", ["x"]) is False  # best effort: logged, not raised
    with pytest.raises(ValueError, match="'read'"):
        reader.notify(OWNER, "read", ["x"])


def test_read_from_unknown_peer_is_a_clear_error(reader):
    table = {"flat": [0], "depth": [[0], [1], [2]]}
    with pytest.raises(UnknownPeerError, match=r"unknown peer engine 'prefill-9'.*known peers: \['prefill-0'\]"):
        reader.start_read("r", "prefill-9", table, table, 1)


@pytest.mark.parametrize("remote,local,num_tokens,match", [
    ({"flat": [0], "depth": [[96], [1], [2]]}, None, 1, r"remote table depth\[0\] block id 96 is outside the looped pool \[0, 96\)"),
    (None, {"flat": [32], "depth": [[0], [1], [2]]}, 1, r"local table flat block id 32 is outside the flat pool \[0, 32\)"),
    (None, {"flat": [0], "depth": [[0], [1, 2], [3]]}, 17, r"local table depth\[0\] has 1 blocks, fewer than the 2"),
    (None, {"flat": [0], "depth": [[0], [1]]}, 1, "remote table has 3 depth planes and local table 2"),
    (None, {"flat": [0], "depth": [[5], [6], [5]]}, 1, "local looped block 5 appears twice"),
    (None, None, 0, "num_tokens must be an integer >= 1, got 0"),
])
def test_bad_tables_are_refused_naming_the_value_and_limit(reader, remote, local, num_tokens, match):
    ok = {"flat": [0, 1], "depth": [[0, 1], [2, 3], [4, 5]]}
    with pytest.raises(ValueError, match=match):
        reader.start_read("bad", OWNER, remote or ok, local or ok, num_tokens)
    assert reader.poll() == ([], [])  # nothing was posted


@pytest.mark.parametrize("shapes,dtype,block_size,expect", [
    ({"looped": (8, 4, 2, 8, 2, 64), "flat": (4, 2, 2, 8, 2, 64)}, DTYPE, 8, "block_size is 16 on 'prefill-0' but 8"),
    (SHAPES, torch.float16, BLOCK_SIZE, "kv_dtype is 'bfloat16' on 'prefill-0' but 'float16'"),
    ({**SHAPES, "looped": (8, 5, 2, BLOCK_SIZE, 2, 64)}, DTYPE, BLOCK_SIZE,
     r"looped_block_shape is \[4, 2, 16, 2, 64\] on 'prefill-0' but \[5, 2, 16, 2, 64\]"),
    ({"looped": SHAPES["looped"]}, DTYPE, BLOCK_SIZE, r"flat_block_shape is \[2, 2, 16, 2, 64\] on 'prefill-0' but None"),
])
def test_handshake_refuses_a_layout_mismatch_naming_both_values(owner, shapes, dtype, block_size, expect):
    w = NixlKVWorker("decode-x", make_pools(3, shapes=shapes, dtype=dtype), block_size, COMPAT)
    with pytest.raises(KVCompatError, match=expect):
        w.add_peer(owner.info)
    assert w.peers == []
    w.close()


def test_handshake_refuses_an_engine_compat_mismatch_and_closed_worker_refuses_work(owner):
    w = NixlKVWorker("decode-y", reader_pools(), BLOCK_SIZE, {**COMPAT, "model": "tiny-ouro"})
    with pytest.raises(KVCompatError, match="model is 'tiny-huginn' on 'prefill-0' but 'tiny-ouro' on 'decode-y'"):
        w.add_peer(owner.info)
    w.close()
    w.close()  # idempotent
    with pytest.raises(KVTransferError, match="'decode-y' is closed"):
        w.add_peer(owner.info)


@pytest.mark.parametrize("pools,block_size,compat,match", [
    ({"looped": torch.zeros(4, 1, 2, 16, 1, 8), "other": torch.zeros(4, 1, 2, 16, 1, 8)}, 16, None, "unknown pool names"),
    ({"flat": torch.zeros(4, 1, 2, 16, 1, 8)}, 16, None, "'looped' is required"),
    ({"looped": torch.zeros(4, 1, 2, 16, 8)}, 16, None, r"must be \[num_blocks, layers, 2"),
    ({"looped": torch.zeros(4, 1, 2, 8, 1, 8)}, 16, None, "8 tokens per block but block_size is 16"),
    ({"looped": torch.zeros(8, 1, 2, 16, 1, 8)[::2]}, 16, None, "must be contiguous"),
    ({"looped": torch.zeros(4, 1, 2, 16, 1, 8), "flat": torch.zeros(4, 1, 2, 16, 1, 8, dtype=torch.float16)}, 16,
     None, "both must match"),
    ({"looped": torch.zeros(4, 1, 2, 16, 1, 8)}, 16, {"block_size": 8}, "compat.'block_size'. is 8 but the pools say 16"),
    ({"looped": torch.zeros(4, 1, 2, 16, 1, 8)}, 0, None, "block_size must be an integer >= 1, got 0"),
])
def test_bad_pools_are_refused_before_nixl_starts(pools, block_size, compat, match):
    with pytest.raises(ValueError, match=match):
        NixlKVWorker("decode-z", pools, block_size, compat)


def test_a_restarted_peer_is_shaken_hands_with_again(owner, reader):
    old_agent = owner.info["agent_name"]
    owner.restart(seed=5)
    assert owner.info["agent_name"] != old_agent
    reader.add_peer(owner.info)  # replaces the dead agent under the same engine id
    assert reader.peers == [OWNER]
    table = {"flat": [3], "depth": [[7], [8], [9]]}
    reader.start_read("after-restart", OWNER, table, table, BLOCK_SIZE)
    assert wait_reads(reader, ["after-restart"]) == (["after-restart"], [])
    src = owner.data()
    assert torch.equal(reader.pools["looped"][[7, 8, 9]], src["looped"][[7, 8, 9]])
    assert torch.equal(reader.pools["flat"][3], src["flat"][3])
    assert owner.notes(count=1)["read"] == ["after-restart"]


def test_ucx_backend_failure_raises_at_construction(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "no-such-transport")
    with pytest.raises(NixlUnavailableError, match="could not start its UCX backend.*no-such-transport"):
        NixlKVWorker("decode-broken", reader_pools(), BLOCK_SIZE, COMPAT)


@pytest.mark.gpu
def test_vram_pools_read_between_processes():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    o = Owner(device="cuda")
    try:
        w = NixlKVWorker("decode-gpu", reader_pools("cuda"), BLOCK_SIZE, COMPAT)
        assert w.layouts["looped"].mem_type == "VRAM"
        w.add_peer(o.info)
        remote = {"flat": [1, 2, 9], "depth": [[0, 1, 2], [40, 41, 7], [90, 91, 95]]}
        local = {"flat": [5, 6, 7], "depth": [[10, 11, 12], [13, 14, 30], [3, 2, 1]]}
        w.start_read("gpu", OWNER, remote, local, 3 * BLOCK_SIZE)
        assert wait_reads(w, ["gpu"]) == (["gpu"], [])
        src = o.data()
        for r, l in zip(remote["depth"], local["depth"]):
            assert torch.equal(w.pools["looped"][l].cpu(), src["looped"][r])
        assert torch.equal(w.pools["flat"][local["flat"]].cpu(), src["flat"][remote["flat"]])
        assert o.notes(count=1)["read"] == ["gpu"]
        w.close()
    finally:
        o.stop()
