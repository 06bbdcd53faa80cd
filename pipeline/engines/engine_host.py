"""Where a worker's engine lives: one per worker VM, shared by every DoFn instance and SDK process.

vLLM's continuous batching works best with every request of the worker in
flight against one server, so all DoFn instances and SDK processes on a VM
share one engine through Beam's ``MultiProcessShared``: the first process to
ask builds it (and with it the model manager's server), the others call it
through a proxy.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import uuid

from apache_beam.utils.multi_process_shared import MultiProcessShared

from pipeline.engines.engine import EngineBase, EngineSettings
from pipeline.engines.vllm_engine import VLLMEngine

# Engines this process has acquired, by tag. Runners may set up and tear down
# DoFn instances per bundle (the DirectRunner does), so the reference is held
# for the life of the process rather than released in teardown, which would
# stop the server; the engine closes itself (and its server) at exit.
_ACQUIRED: dict[str, EngineBase] = {}
_ACQUIRE_LOCK = threading.Lock()


def new_engine_tag(settings: EngineSettings) -> str:
    """A tag for one pipeline's engine: shared by its steps on a worker, never with another job's."""
    return "streaming-llm-" + hashlib.sha1((repr(settings) + uuid.uuid4().hex).encode()).hexdigest()[:16]


def build_engine(settings: EngineSettings) -> EngineBase:
    """The engine the settings name; transformers is imported only by workers that use it."""
    if settings.engine == "transformers":
        from pipeline.engines.transformers_engine import TransformersEngine
        if not logging.getLogger().handlers:  # its own process (see acquire_engine): log where the worker does
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return TransformersEngine(settings)
    return VLLMEngine(settings)


def acquire_engine(settings: EngineSettings, tag: str, *, fresh: bool = False) -> EngineBase:
    """The worker-wide engine: the first process to ask builds it, the others proxy to it.

    ``fresh`` drops this process's cached handle first (its hosting process died).
    The transformers engine gets a process of its own: its decoding loop is Python
    between many small torch calls, and in a process whose other threads run the
    pipeline it waited for the GIL at every call, several times slower a decoding
    step on the DirectRunner.
    """
    with _ACQUIRE_LOCK:
        if fresh:
            _ACQUIRED.pop(tag, None)
        if tag not in _ACQUIRED:
            shared = MultiProcessShared(functools.partial(build_engine, settings), tag=tag,
                                        spawn_process=settings.engine == "transformers")
            _ACQUIRED[tag] = shared.acquire()
        return _ACQUIRED[tag]


def acquired_engines() -> list[EngineBase]:
    """The engines this process has acquired so far (a local source admits through its pipeline's)."""
    with _ACQUIRE_LOCK:
        return list(_ACQUIRED.values())
