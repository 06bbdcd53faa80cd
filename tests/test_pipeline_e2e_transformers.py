"""The end-to-end checks of tests/test_pipeline_e2e.py on ``engine=transformers``: the same traffic through the
same template, each batch generated together in the pipeline's own process, and no model server.

Two checks of that module are vLLM's alone: a short request streaming beside a long one (static batching runs one
batch at a time, so a batch waits for the one before it: README) and the bulk lane (it uses vLLM's priority
scheduling). This module shares no vLLM, so ``make test`` runs it beside the modules that do.
"""

from __future__ import annotations

import pytest

from tests.test_pipeline_e2e import (  # noqa: F401  the checks, collected here against this module's run
    template_run,
    test_bigquery_holds_the_same_completions_chunks_and_dead_letters,
    test_chunks_are_gapless_and_add_up_to_the_final_text,
    test_every_message_ends_as_exactly_one_completion_or_dead_letter,
    test_malformed_messages_are_dead_letters_with_their_reason,
    test_per_request_parameters_are_honoured,
    test_the_model_server_is_gone_when_the_pipeline_stops,
)

pytestmark = [pytest.mark.engine, pytest.mark.model_in_process]


@pytest.fixture(scope="module")
def run(checkpoint, emulator, bigquery):
    yield from template_run("transformers", "length-buckets", checkpoint, emulator, bigquery)
