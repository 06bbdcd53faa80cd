"""On a machine without a GPU, the local pipeline's threads stay off the cores the model computes on.

vLLM's CPU build binds its compute threads to all but the last of the cores it may use and leaves
those to its own front end. Left to the OS, the pipeline's threads land on the model's cores too,
where each one waits behind a compute thread that does not yield: on a 2-core machine the first
chunk took seconds. The local launcher (:mod:`local.direct_runner`) watches for the server's
threads to be bound (the kernel's record, not a guess of vLLM's rule) and moves the pipeline's
threads onto the other cores. A GPU worker computes on the GPU and binds nothing, which is why this
lives outside the worker package.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.parse
from pathlib import Path

LOGGER = logging.getLogger(__name__)
_PROC = Path("/proc")


def _allowed(tid: int) -> frozenset[int]:
    """The cores a thread (or, by its pid, a process's main thread) may run on."""
    return frozenset(os.sched_getaffinity(tid))


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from each process's parent in ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def bound_cores(pid: int) -> frozenset[int]:
    """The cores that threads of ``pid``'s process tree are bound to, narrower than ``pid``'s own set.

    ``pid`` is the server's front end, which vLLM leaves unbound; its engine's
    worker binds every thread it has, its main thread too.
    """
    try:
        own = _allowed(pid)
    except OSError:  # it ended
        return frozenset()
    bound: set[int] = set()
    for process in _tree(pid):
        try:
            for task in (_PROC / str(process) / "task").iterdir():
                cores = _allowed(int(task.name))
                if cores < own:
                    bound |= cores
        except OSError:  # it ended meanwhile
            continue
    return frozenset(bound)


def pipeline_processes() -> list[int]:
    """This process and its descendants in its own session: the pipeline's processes, the worker's runtime host
    among them (a spawned child). A vLLM server runs in a session of its own (``VLLMServer``), and so does what
    it starts, so none of its processes is among these."""
    session = os.getsid(0)
    found = []
    for pid in _tree(os.getpid()):
        try:
            if os.getsid(pid) == session:
                found.append(pid)
        except OSError:  # it ended meanwhile
            continue
    return found


def keep_off(cores: frozenset[int]) -> frozenset[int] | None:
    """Moves every thread of the pipeline's processes (:func:`pipeline_processes`), and so the threads and
    processes they start later, off ``cores``.

    Returns the cores they now run on, or None when it changed nothing: nothing
    to keep off, already off, or no core would be left.
    """
    allowed = frozenset(os.sched_getaffinity(0))
    rest = allowed - cores
    if not cores or not rest or rest == allowed:
        return None
    for pid in pipeline_processes():
        try:
            tasks = list((_PROC / str(pid) / "task").iterdir())
        except OSError:  # it ended meanwhile
            continue
        for task in tasks:
            try:
                os.sched_setaffinity(int(task.name), rest)
            except OSError:  # the thread ended meanwhile
                continue
    return rest


def listening_pid(port: int) -> int | None:
    """The process on this machine that listens on TCP ``port`` (one it may inspect), if any."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:  # it ended meanwhile, or is not ours to inspect
            continue
    return None


def keep_pipeline_off(model_cores: frozenset[int]) -> None:
    """:func:`keep_off` for the pipeline's processes, logged once when they move."""
    moved = keep_off(model_cores)
    if moved is not None:
        LOGGER.info("Pipeline threads of processes %s moved to cores %s, off the model's cores %s",
                    pipeline_processes(), sorted(moved), sorted(model_cores))


def _local_port(server_url: str) -> int | None:
    url = urllib.parse.urlsplit(server_url)
    return url.port if url.hostname in ("localhost", "127.0.0.1", "::1") else None


def model_cores(server_url: str | None = None) -> frozenset[int]:
    """The cores this machine's vLLM binds its compute to: the server listening on a loopback ``server_url``'s
    port, else the servers this process started (threads in its tree bound narrower than its own).
    Empty with a GPU or a server elsewhere."""
    if server_url:
        port = _local_port(server_url)
        pid = listening_pid(port) if port is not None else None
        return bound_cores(pid) if pid is not None else frozenset()
    return bound_cores(os.getpid())


def keep_pipeline_off_local_model(server_url: str | None = None, interval_s: float = 0.5,
                                  patience_s: float = 3600.0) -> threading.Thread:
    """Watches (on a daemon thread) for this machine's vLLM to bind its compute, then moves this process off it.

    Once moved, threads this process starts later inherit the narrower set from the thread that starts
    them; the model manager starts every server, restarts included, on the cores it had at first.
    """
    def watch() -> None:
        deadline = time.monotonic() + patience_s
        while time.monotonic() < deadline:
            cores = model_cores(server_url)
            if cores:
                keep_pipeline_off(cores)
                return
            time.sleep(interval_s)

    watcher = threading.Thread(target=watch, name="keep-off-model-cores", daemon=True)
    watcher.start()
    return watcher
