"""The TCP sockets a process tree listens on, read from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net writes them
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
# `ray start --head`'s defaults: GCS, dashboard, dashboard agent, Ray client server
RAY_DEFAULT_PORTS = {6379, 8265, 52365, 10001}


def _tree(pid: int) -> set[int]:
    pids, todo = set(), [pid]
    while todo:
        p = todo.pop()
        pids.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            todo.extend(int(c) for c in children if int(c) not in pids)
    return pids


def _listening() -> dict[int, tuple[str, int]]:
    """Socket inode -> (local address hex, port) of every TCP socket in LISTEN state."""
    found = {}
    for name, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                addr, port = fields[1].split(":")
                found[int(fields[9])] = (addr[:width], int(port, 16))
    return found


def listening_sockets(root: int) -> list[tuple[int, str, str, int]]:
    """(pid, command, address hex, port) of every listening TCP socket of `root`'s process tree."""
    listening = _listening()
    sockets = []
    for pid in _tree(root):
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except (FileNotFoundError, PermissionError):
            continue
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in listening:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                sockets.append((pid, comm, *listening[int(link[8:-1])]))
    return sockets
