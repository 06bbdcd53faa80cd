"""The Dataflow job this template submits, built offline by Beam's own DataflowRunner and checked.

How it runs without Google Cloud (docs/testing.md): ``--template_location`` makes Beam 2.77's DataflowRunner write
the job description it would send to a file instead of calling the Dataflow API
(``apache_beam/runners/dataflow/internal/apiclient.py``, ``create_job``); ``--no_auth`` skips looking for
credentials; the pipeline and its dependencies are staged to the project's Cloud Storage emulator
(``STORAGE_EMULATOR_HOST``). The entry point is started as the Flex Template launcher starts it from a console
launch: only the required parameters, in the launcher image's environment, which names its workers' image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from apache_beam.portability.api import beam_runner_api_pb2

from local.emulators import GcsEmulator
from tests.conftest import activated
from pipeline.config.launch_checks import WORKER_IMAGE_ENV
from pipeline.contract.parameters import DEFAULT_DISK_SIZE_GB, DEFAULT_HARNESS_THREADS

REPO = Path(__file__).resolve().parent.parent
WORKER_IMAGE = "us-central1-docker.pkg.dev/proj-123456/dataflow/streaming-llm-worker:0123456789ab"
GPU = "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver:latest"
# Key coders whose encoding is deterministic (Beam's standard coders); a pickled key would move between workers.
DETERMINISTIC_KEY_CODERS = {"beam:coder:string_utf8:v1", "beam:coder:varint:v1", "beam:coder:bytes:v1"}


def build_job(folder: Path, *extra: str):
    """(the job description, the staged pipeline) of a console-style launch with these parameters besides."""
    with GcsEmulator() as gcs, activated(gcs):  # restored after: a later test must not reach a stopped emulator
        from pipeline.serving.model_weights import storage_client

        client = storage_client()
        client.create_bucket("bkt-test")
        args = ["--runner=DataflowRunner", "--project=proj-123456", "--region=us-central1",
                "--temp_location=gs://bkt-test/tmp", "--staging_location=gs://bkt-test/staging",
                f"--experiments={GPU}", "--no_auth", f"--template_location={folder / 'job.json'}",
                "--input_subscription=projects/proj-123456/subscriptions/prompts-sub",
                "--output_completions_topic=projects/proj-123456/topics/completions",
                "--dead_letter_topic=projects/proj-123456/topics/dead", *extra]
        result = subprocess.run([sys.executable, "-m", "template.main", *args], cwd=REPO, capture_output=True,
                                text=True, timeout=300, env={**os.environ, **gcs.env(), WORKER_IMAGE_ENV: WORKER_IMAGE})
        assert result.returncode == 0, result.stderr[-3000:]
        staged = [blob for blob in client.list_blobs("bkt-test") if blob.name.endswith("/pipeline.pb")]
        assert len(staged) == 1, [blob.name for blob in client.list_blobs("bkt-test")]
        pipeline = beam_runner_api_pb2.Pipeline.FromString(staged[0].download_as_bytes())
    return json.loads((folder / "job.json").read_text()), pipeline


@pytest.fixture(scope="module")
def built_job(tmp_path_factory):
    return build_job(tmp_path_factory.mktemp("dataflow-job"))


def test_the_job_is_a_streaming_job_on_gpu_workers_running_the_worker_image(built_job):
    job, _ = built_job
    environment = job["environment"]
    assert job["type"] == "JOB_TYPE_STREAMING"
    assert GPU in environment.get("serviceOptions", []) + environment["experiments"]
    assert {"use_runner_v2", "enable_streaming_engine"} <= set(environment["experiments"])
    (pool,) = environment["workerPools"]
    assert pool["diskSizeGb"] == DEFAULT_DISK_SIZE_GB  # set by the launch, as the console sets none
    # Set by the launch too: the runtime client keeps a call thread for each work item a worker runs at once.
    assert pool["numThreadsPerWorker"] == DEFAULT_HARNESS_THREADS
    assert pool["workerHarnessContainerImage"] == WORKER_IMAGE
    assert {image["containerImage"] for image in pool["sdkHarnessContainerImages"]} == {WORKER_IMAGE}


def test_the_job_reads_its_subscription_with_its_own_reader_and_keys_state_by_deterministic_coders(built_job):
    """Not Dataflow's Pub/Sub source: the job's reader, a splittable DoFn that asks for bundle finalization (it
    acknowledges there), run as its readers, one element each, on the job's subscription
    (docs/architecture.md, "Backpressure")."""
    from apache_beam.internal import pickler

    from pipeline.flow.subscription_reader import PullWithinRoomFn, readers_for

    _, pipeline = built_job
    components = pipeline.components
    assert not [t for t in components.transforms.values() if t.spec.urn == "beam:transform:pubsub_read:v1"]
    readers, elements = [], []
    for transform in components.transforms.values():
        if transform.spec.urn != "beam:transform:pardo:v1" or not transform.unique_name.startswith("ReadPrompts/"):
            continue
        payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
        fn = pickler.loads(payload.do_fn.payload)[0]
        if isinstance(fn, PullWithinRoomFn):
            readers.append((payload.restriction_coder_id != "", payload.requests_finalization))
        elif transform.unique_name.endswith("/Readers"):
            elements = list(fn._fn(None))
    assert readers == [(True, True)], "one splittable reader that acknowledges in its bundle finalizer"
    # No max_num_workers at launch: readers for Dataflow's default ceiling of a Streaming Engine job.
    assert elements == [("projects/proj-123456/subscriptions/prompts-sub", n) for n in range(readers_for(None))]
    stateful = _stateful_steps(pipeline)
    assert any("BatchRequests" in name for name in stateful) and any("StreamingGenerate" in name for name in stateful)
    assert {key_coder for _, _, key_coder in stateful.values()} <= DETERMINISTIC_KEY_CODERS, stateful


def test_every_answer_of_the_job_names_the_worker_image_it_runs_in_its_lineage(built_job):
    """The launcher fills sdk_container_image with its own worker image; the engine settings the generate step
    carries to the workers (pickled in the staged pipeline) name the same image, which each completion's lineage
    records (docs/contract.md#lineage)."""
    from apache_beam.internal import pickler

    _, pipeline = built_job
    images = []
    for transform in pipeline.components.transforms.values():
        if transform.spec.urn == "beam:transform:pardo:v1" and "StreamingGenerate" in transform.unique_name:
            payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
            fn = pickler.loads(payload.do_fn.payload)[0]
            source = getattr(fn, "_source", None)
            if source is not None:
                images.append(source.settings.engine.image)
    assert images and set(images) == {WORKER_IMAGE}, images


def _stateful_steps(pipeline) -> dict[str, tuple]:
    """Each stateful step by name: its state and timer specs and its key coder, what an update must find again."""
    components, found = pipeline.components, {}
    for transform in components.transforms.values():
        if transform.spec.urn != "beam:transform:pardo:v1":
            continue
        payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
        if payload.state_specs or payload.timer_family_specs:
            (main,) = [pcoll for name, pcoll in transform.inputs.items() if name not in payload.side_inputs]
            coder = components.coders[components.pcollections[main].coder_id]
            assert coder.spec.urn == "beam:coder:kv:v1", transform.unique_name
            found[transform.unique_name] = (
                sorted(payload.state_specs), sorted(payload.timer_family_specs),
                components.coders[coder.component_coder_ids[0]].spec.urn)
    return found


def test_a_job_updated_to_read_a_bulk_lane_keeps_every_stateful_step_as_it_was(built_job, tmp_path):
    """Dataflow's update maps state by step name, and its compatibility check refuses a stateful step whose state
    or key coder changed ("Update an existing pipeline", cloud.google.com/dataflow/docs/guides/updating-a-pipeline):
    the lane adds a second reader and leaves each stateful step, its cells and its key coder as they were."""
    from apache_beam.internal import pickler

    from pipeline.flow.subscription_reader import PullWithinRoomFn

    _, before = built_job
    _, after = build_job(tmp_path, "--bulk_subscription=projects/proj-123456/subscriptions/bulk-sub")
    assert _stateful_steps(after) == _stateful_steps(before)
    lanes = {}
    for transform in after.components.transforms.values():
        if transform.spec.urn == "beam:transform:pardo:v1":
            payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
            fn = pickler.loads(payload.do_fn.payload)[0]
            if isinstance(fn, PullWithinRoomFn):
                lanes[transform.unique_name.split("/")[0]] = fn._bulk
    assert lanes == {"ReadPrompts": False, "ReadBulkPrompts": True}
