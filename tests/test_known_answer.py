"""The local model answers a question whose answer is known: a broken numeric path fails here, before the rest.

The settings the server runs with come from :data:`local.cpu_server.LOCAL_SERVER`
through the same option path the pipeline uses (``tests.conftest.local_server_spec``).
conftest runs this test first and stops the suite if it fails.
"""

import pytest

from local.cpu_server import KNOWN_QUESTION, known_answer_problem
from tests.conftest import chat

pytestmark = [pytest.mark.engine, pytest.mark.known_answer]


def test_the_managed_server_answers_a_known_question(vllm_server):
    answer = chat(vllm_server.base_url, KNOWN_QUESTION, temperature=0, max_tokens=24)["choices"][0]["message"]
    problem = known_answer_problem(answer["content"] or "")
    assert problem is None, problem
