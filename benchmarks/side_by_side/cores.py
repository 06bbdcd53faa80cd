"""Which cores the server and the pipelines run on, and what the pipelines' processes cost.

On a GPU worker the engine computes on the GPU and leaves the CPUs to the
pipeline; on a CPU-only machine vLLM's compute takes every core and starves
the pipeline's Python threads. "isolated" reproduces the first: the server
on one set of cores (its OpenMP threads bound there through
``VLLM_CPU_OMP_THREADS_BIND``), this process, the emulator and the pipelines
on the rest. "shared" is what a CPU-only user gets: the server where vLLM's
CPU build binds itself, everything else anywhere.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class CorePlan:
    name: str  # "isolated" or "shared"
    server: frozenset[int]
    clients: frozenset[int]

    def server_env(self) -> dict[str, str]:
        if self.name != "isolated":
            return {}
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in sorted(self.server))}

    def describe(self) -> str:
        if self.name == "isolated":
            return f"server on cores {_cpus(self.server)}, pipelines and clients on {_cpus(self.clients)}"
        return f"the server where vLLM binds itself, everything else anywhere on cores {_cpus(self.clients)}"


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def plans(names: list[str], available: set[int] | None = None) -> list[CorePlan]:
    """The plans asked for; "isolated" gives the server the last quarter of the cores (at least one)."""
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    result = []
    for name in names:
        if name == "shared":
            result.append(CorePlan("shared", frozenset(cpus), frozenset(cpus)))
        elif name == "isolated":
            if len(cpus) < 2:
                raise ValueError("isolated cores need at least 2 cores; use --cores shared")
            split = len(cpus) - max(1, len(cpus) // 4)
            result.append(CorePlan("isolated", frozenset(cpus[split:]), frozenset(cpus[:split])))
        else:
            raise ValueError(f"unknown core plan {name!r}: use isolated, shared or both")
    return result


def _tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its live descendants; empty when it has ended."""
    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` and its live descendants."""
    ids = []
    for process in _tree(pid):
        try:
            ids += [int(thread) for thread in os.listdir(f"/proc/{process.pid}/task")]
        except FileNotFoundError:  # the process ended meanwhile
            continue
    return ids


def pin_tree(pid: int, cpus: frozenset[int]) -> None:
    """Moves every thread of ``pid`` and its descendants onto ``cpus``."""
    for thread in _threads(pid):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(thread, cpus)


def renice_tree(pid: int, niceness: int) -> None:
    """Sets the niceness of every thread of ``pid`` and its descendants (Linux keeps it per thread)."""
    for thread in _threads(pid):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.setpriority(os.PRIO_PROCESS, thread, niceness)


def pin_this_process(cpus: frozenset[int]) -> None:
    """This process, its descendants so far, and whatever it starts from now on, onto ``cpus``."""
    pin_tree(os.getpid(), cpus)
    os.sched_setaffinity(0, cpus)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants so far."""
    total = 0.0
    for process in _tree(pid):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` itself so far, its children excluded (0 once it has ended)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def peak_rss_mib(pid: int) -> float:
    """The peak resident memory of ``pid`` and its descendants over their lives (VmHWM), MiB."""
    total = 0
    for process in _tree(pid):
        try:
            with open(f"/proc/{process.pid}/status", encoding="ascii") as status:
                total += sum(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except FileNotFoundError:
            continue
    return total / 1024
