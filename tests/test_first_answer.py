"""README step 7 from the terminal: `make publish` sends prompts to the job's input topic and `make tail` prints the
job's chunks, completions and dead letters as they arrive, against the Pub/Sub emulator, through the real targets.
What stands in for the job is this test publishing the records the contract defines to the output topics."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import time
from pathlib import Path

from local.emulators import PROJECT, PubSubEmulator
from ops import setup_project
from ops.settings import Settings, output_subscription

REPO = Path(__file__).resolve().parent.parent
RUNS = itertools.count()
# A prompt no shell word or make variable carries as it is.
HOSTILE = "Say \"hi\", it's 'me' $HOME `x` \\ ; & ünï 🙂"


def make(target: str, emulator, **variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **emulator.env()}
    args = ["make", "--no-print-directory", target, "ENV_FILE=/dev/null", f"PROJECT={PROJECT}", "BUCKET=bkt-test"]
    return subprocess.run(args + [f"{key}={value}" for key, value in variables.items()], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def job_topics(emulator) -> dict[str, str]:
    """A job's topics, as make setup makes them: an input with its subscription, and outputs with theirs."""
    run = next(RUNS)
    names = {"INPUT_TOPIC": f"fa{run}-prompts", "CHUNKS_TOPIC": f"fa{run}-chunks",
             "COMPLETIONS_TOPIC": f"fa{run}-completions", "DEAD_LETTER_TOPIC": f"fa{run}-dead-letters"}
    emulator.create_topic(names["INPUT_TOPIC"], subscription=f"fa{run}-prompts-sub")
    from google.cloud import pubsub_v1

    subscriber = pubsub_v1.SubscriberClient()
    for name in ("CHUNKS_TOPIC", "COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC"):
        topic = emulator.create_topic(names[name], subscription=output_subscription(
            emulator.topic(names[name]), "tail").rsplit("/", 1)[1], ordering=name == "CHUNKS_TOPIC")
        if name != "CHUNKS_TOPIC":
            subscriber.create_subscription(request={"name": output_subscription(topic), "topic": topic})
    subscriber.close()
    return names


def test_make_publish_sends_a_prompt_or_a_file_of_requests_intact_each_with_an_id(emulator, tmp_path):
    names = job_topics(emulator)
    one = make("publish", emulator, INPUT_TOPIC=names["INPUT_TOPIC"], PROMPT=HOSTILE)
    assert one.returncode == 0, one.stdout + one.stderr
    (request,) = [json.loads(data) for data in PubSubEmulator.take(emulator.subscription(f"{names['INPUT_TOPIC']}-sub"))]
    assert request["prompt"] == HOSTILE and request["id"] in one.stdout and "make tail" in one.stdout
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('{"id": "mine", "prompt": "Classify: late parcel", "max_tokens": 8}\nPlain text line\n\n'
                       '{not json\n', encoding="utf-8")
    many = make("publish", emulator, INPUT_TOPIC=names["INPUT_TOPIC"], PROMPTS=str(prompts))
    assert many.returncode == 0, many.stdout + many.stderr
    sent = PubSubEmulator.take(emulator.subscription(f"{names['INPUT_TOPIC']}-sub"))
    assert len(sent) == 3, "one message a non-empty line"
    parsed = {data: json.loads(data) if data.startswith(b"{\"") else None for data in sent}
    requests = [r for r in parsed.values() if r]
    assert {"id": "mine", "prompt": "Classify: late parcel", "max_tokens": 8} in requests
    assert any(r["prompt"] == "Plain text line" and r["id"].startswith("cli-") for r in requests)
    assert b"{not json" in sent, "sent as written: the job's dead letter says what is wrong with it"
    missing = make("publish", emulator, INPUT_TOPIC=names["INPUT_TOPIC"])
    assert missing.returncode != 0 and "Set PROMPT=" in missing.stderr


def test_make_tail_prints_chunks_then_the_answer_and_dead_letters_as_they_arrive(emulator):
    from google.cloud import pubsub_v1

    names = job_topics(emulator)
    publisher = pubsub_v1.PublisherClient()
    records = [("CHUNKS_TOPIC", {"id": "q-1", "attempt": 1, "stream": "s", "seq": 0, "text": "Hel", "tokens": 1,
                                 "final": False, "finish_reason": None, "time_to_first_token_ms": 120.0}),
               ("CHUNKS_TOPIC", {"id": "q-1", "attempt": 1, "stream": "s", "seq": 1, "text": "lo!", "tokens": 2,
                                 "final": True, "finish_reason": "stop", "time_to_first_token_ms": 120.0}),
               ("COMPLETIONS_TOPIC", {"id": "q-1", "text": "Hello!", "finish_reason": "stop",
                                      "time_to_first_token_ms": 120.0, "output_json": {"category": "billing"},
                                      "usage": {"prompt_tokens": 3, "completion_tokens": 2}}),
               ("DEAD_LETTER_TOPIC", {"id": "q-2", "stage": "parse", "reason": "'prompt' must be a string"})]
    for name, record in records:  # what the job would publish
        publisher.publish(emulator.topic(names[name]), json.dumps(record).encode()).result(timeout=30)
    started = time.monotonic()
    tail = make("tail", emulator, **names, TAIL_ARGS="--until 2 --seconds 120")
    assert tail.returncode == 0, tail.stdout + tail.stderr
    assert time.monotonic() - started < 120, "stopped after the two answers, not at the time limit"
    assert "q-1 #0: Hel" in tail.stdout and "q-1 #1: lo!" in tail.stdout, "a chunk after its completion is shown"
    assert "Error" not in tail.stderr, "every callback ended before the channel closed"
    assert 'q-1 done: 2 tokens, first token 0.12 s, stop; answer {"category": "billing"}' in tail.stdout
    assert "q-2 dead letter (parse): 'prompt' must be a string" in tail.stdout
    for name in ("CHUNKS_TOPIC", "COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC"):  # what was printed was acknowledged
        assert not PubSubEmulator.take(output_subscription(emulator.topic(names[name]), "tail"))
    for name in ("COMPLETIONS_TOPIC", "DEAD_LETTER_TOPIC"):  # ... in its own copy: an app's and redrive's remain
        assert len(PubSubEmulator.take(output_subscription(emulator.topic(names[name])))) == 1
    assert "out of order" not in tail.stdout, "make setup's chunk subscription orders by key"
    again = make("tail", emulator, **{**names, "CHUNKS_TOPIC": "fa-no-such-topic"}, TAIL_ARGS="--seconds 3")
    assert again.returncode == 0 and "(no projects/local-project/subscriptions/fa-no-such-topic-tail" in again.stdout
    unordered = f"fa-unordered-{next(RUNS)}"  # a chunk subscription an older make setup made: named, still shown
    emulator.create_topic(unordered, subscription=f"{unordered}-tail")
    old = make("tail", emulator, **{**names, "CHUNKS_TOPIC": unordered}, TAIL_ARGS="--seconds 2")
    assert old.returncode == 0 and "may print out of order" in old.stdout and f"{unordered}-tail" in old.stdout


class RefusingPubSub:
    """A Pub/Sub endpoint on loopback that refuses every call with PERMISSION_DENIED, as the service answers a
    caller without a role on the resource (https://cloud.google.com/pubsub/docs/access-control)."""

    def __init__(self) -> None:
        import grpc
        from concurrent import futures

        class Refuse(grpc.GenericRpcHandler):
            def service(self, details):
                def refuse(request, context):
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, "User not authorized to perform this action.")
                return grpc.unary_unary_rpc_method_handler(refuse)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[Refuse()])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def env(self) -> dict[str, str]:
        return {"PUBSUB_EMULATOR_HOST": f"127.0.0.1:{self.port}", "PUBSUB_PROJECT_ID": PROJECT}


def test_make_tail_without_the_role_to_read_says_which_roles_to_ask_for():
    refusing = RefusingPubSub()
    try:
        tail = make("tail", refusing, TAIL_ARGS="--seconds 5")
    finally:
        refusing.server.stop(None)
    assert tail.returncode == 2, tail.stdout + tail.stderr
    assert "roles/pubsub.subscriber" in tail.stderr and "Traceback" not in tail.stderr
    said = [line for line in tail.stderr.splitlines() if line.startswith("make tail:")]
    # make's own line for the failed recipe is "make:", or "make[N]:" under another make (make test).
    assert len(said) == 1 and said == [line for line in tail.stderr.splitlines()
                                       if not re.match(r"make(\[\d+\])?: \*\*\*", line)], tail.stderr


def test_make_setup_creates_the_subscriptions_make_tail_an_app_and_redrive_read():
    """Pub/Sub keeps nothing on a topic without a subscription: the first answers would be lost."""
    settings = Settings({"PROJECT": PROJECT, "REGION": "us-central1", "BUCKET": "bkt-test",
                         "INPUT_TOPIC": "prompts", "INPUT_SUBSCRIPTION": "prompts-sub", "CHUNKS_TOPIC": "llm-chunks",
                         "COMPLETIONS_TOPIC": "llm-completions", "DEAD_LETTER_TOPIC": "llm-dead-letters"})
    text = "\n".join(" ".join(c) for c in setup_project.commands(settings))
    for topic in ("llm-completions", "llm-dead-letters"):
        assert f"subscriptions create {topic}-sub --topic {topic} --expiration-period never --project {PROJECT}" in text
    for topic in ("llm-completions", "llm-dead-letters", "llm-chunks"):
        assert f"subscriptions create {topic}-tail --topic {topic} --expiration-period never " \
               "--message-retention-duration 10m" in text
    assert "llm-chunks-sub" not in text
