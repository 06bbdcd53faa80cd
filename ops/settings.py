"""The deploy settings as the Makefile exports them, the error that names one, and how a target reads gcloud's output.

The standard library only: a target that only calls gcloud (``make setup``, ``make image``) runs on the system's
Python, without the Beam install the launch targets need (:mod:`ops.deploy`).
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from typing import Mapping


class DeployError(ValueError):
    """A deploy setting that cannot work; the message names it and what to set."""


@dataclass(frozen=True)
class Settings:
    """The deploy settings, as the Makefile exports them (empty strings are unset)."""

    values: Mapping[str, str]

    def get(self, name: str) -> str:
        return (self.values.get(name) or "").strip()

    def require(self, *names: str) -> None:
        missing = [name for name in names if not self.get(name)]
        if missing:
            raise DeployError(f"Set {', '.join(missing)} (in .env, see .env.example, or on the make command line)")


def gcloud_output(command: list[str], what: str, dry_run: bool = False) -> str | None:
    """Prints a gcloud command whose output a target reads, runs it and returns that output (None on a dry run,
    which runs nothing); a failure stops the target, naming ``what`` it was for."""
    print(f"==> {shlex.join(command)}", flush=True)
    if dry_run:
        return None
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise DeployError(f"{what} failed: {result.stderr.strip()}")
    return result.stdout
