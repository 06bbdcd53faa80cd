"""What the generate step is built from beside its worker's runtime: one frozen record that checks its own values.

The generate step (:class:`~pipeline.generation.generate.StreamingGenerate`) takes the worker's
:class:`~pipeline.worker.runtime_settings.RuntimeSettings` and this record. The job's settings
(:mod:`pipeline.config.settings`) build it from the template's parameters; a pipeline of one's own builds it directly
and gets the same errors, from the same check (the values' declarations in :mod:`pipeline.contract.parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.contract.parameter_checks import ParameterProblems, check_parameters, not_with_transformers
from pipeline.contract.parameters import default


@dataclass(frozen=True)
class GenerateSettings:
    """The generate step's own settings."""

    # How long a key remembers a request id it has answered, so a redelivered copy is not answered twice.
    dedupe_window_s: float = float(default("dedupe_window_s"))
    # How long a drain lets requests in flight finish before it letters the rest.
    drain_timeout_s: float = float(default("drain_timeout_s"))
    # The step re-keys batches to this many generate keys first; None keeps the batcher's keys. (In the job's
    # settings: the parameter as set, None meaning by runner: JobSettings.generate_step.)
    generate_shards: int | None = None
    # The engine the step feeds: the transformers engine generates each batch whole, on its batching key.
    engine: str = default("engine")

    def __post_init__(self) -> None:
        check_parameters({"dedupe_window_s": self.dedupe_window_s, "drain_timeout_s": self.drain_timeout_s,
                          **({} if self.generate_shards is None else {"generate_shards": self.generate_shards})})
        if self.generate_shards is not None and self.engine == "transformers":
            raise ParameterProblems(not_with_transformers("generate_shards"))
