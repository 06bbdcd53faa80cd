"""The one vLLM server a benchmark measures every system against, started under a core plan (or a running one)."""

from __future__ import annotations

import json
import os
import shlex
import time
import urllib.request

from benchmarks.side_by_side.cores import (
    CorePlan,
    pin_this_process,
    pin_tree,
    process_cpu_seconds,
    renice_tree,
    tree_cpu_seconds,
)
from local.embedded_model import ensure_local_checkpoint
from pipeline.serving.lora_adapters import Adapter

SERVED_NAME = "bench"


class BenchServer:
    """A context manager: the server on the plan's cores (this process on the clients'), or ``server_url``'s."""

    def __init__(self, plan: CorePlan, *, model: str | None, dtype: str, vllm_args: str,
                 server_url: str | None = None, niceness: int | None = None, adapters: tuple[Adapter, ...] = (),
                 max_lora_rank: int = 16) -> None:
        self.plan, self._model, self._dtype, self._vllm_args = plan, model, dtype, vllm_args
        self._server_url, self._niceness = server_url, niceness
        self._adapters, self._max_lora_rank = adapters, max_lora_rank
        self.server = None
        self.start_s = float("nan")

    def __enter__(self) -> BenchServer:
        if self._server_url:
            self.base_url = self._server_url.rstrip("/")
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=10) as response:
                self.model = json.load(response)["data"][0]["id"]
            self.port = int(self.base_url.rsplit(":", 1)[1])
            return self
        from pipeline.serving.vllm_server import ServerSpec, VLLMServer

        spec = ServerSpec(model=self._model or str(ensure_local_checkpoint()), dtype=self._dtype,
                          served_model_name=SERVED_NAME, extra_args=tuple(shlex.split(self._vllm_args)),
                          start_timeout_s=1800, adapters=self._adapters, max_lora_rank=self._max_lora_rank,
                          max_loras=max(1, len(self._adapters)))
        saved = dict(os.environ)
        os.environ.update(self.plan.server_env())
        os.sched_setaffinity(0, self.plan.server)  # the server inherits these cores
        started = time.monotonic()
        try:
            self.server = VLLMServer(spec).start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.start_s = time.monotonic() - started
        if self.plan.name == "isolated":  # "shared" leaves vLLM's own placement (its compute threads bound) alone
            pin_this_process(self.plan.clients)  # with every child so far: the emulator, the server ...
            pin_tree(self.server.pid, self.plan.server)  # ... which then goes back to its own cores
        if self._niceness is not None:
            renice_tree(self.server.pid, self._niceness)
        self.base_url, self.port, self.model = self.server.base_url, self.server.port, SERVED_NAME
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()

    def cpu_seconds(self) -> float | None:
        """The server's process tree's CPU time so far (None for a server this benchmark did not start)."""
        return tree_cpu_seconds(self.server.pid) if self.server is not None else None

    def front_end_cpu_seconds(self) -> float | None:
        """The API server process's own CPU time: HTTP, (de)tokenizing and events, not the engine core's compute.

        vLLM's V1 API server runs the engine core in a child process; on a GPU worker the child drives the GPU
        while this process's work per token is what it is on this CPU.
        """
        return process_cpu_seconds(self.server.pid) if self.server is not None else None
