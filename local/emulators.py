"""Local emulators of Google Cloud services, on loopback, for smoke runs, tests and benchmarks.

Each runs as its own process group (the Pub/Sub emulator's ``gcloud`` wrapper
starts a Java child that does not always die with it), so ``stop`` signals the
group it started and nothing else.

- Pub/Sub: the Google Cloud SDK's real emulator (``gcloud beta emulators pubsub``).
- Cloud Storage: ``gcp-storage-emulator`` (PyPI), a local implementation of the JSON API.
- BigQuery: ``bqemulator`` (PyPI), a DuckDB-backed REST API.

The Python emulators live in their own virtualenv (``.venv-emulators``): their
dependencies (a newer FastAPI) conflict with vLLM's.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.serving.vllm_server import free_port, terminate_process_group

LOGGER = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent
EMULATOR_BIN = Path(os.environ.get("EMULATOR_VENV", REPO_ROOT / ".venv-emulators")) / "bin"
PROJECT = "local-project"


class Emulator:
    """A local server process started by us, probed over HTTP until ready."""

    name = "emulator"
    ready_path = "/"

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.project = PROJECT
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None

    def command(self, workdir: str) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """Variables that point Google's client libraries at this emulator."""
        return {"GOOGLE_CLOUD_PROJECT": self.project}

    def start(self, timeout_s: float = 90.0) -> Emulator:
        self._workdir = tempfile.mkdtemp(prefix=f"{self.name}-")
        log_path = Path(self._workdir) / "emulator.log"
        command = self.command(self._workdir)
        if not shutil.which(command[0]):
            raise RuntimeError(f"{command[0]} not found: {self.install_hint()}")
        with open(log_path, "wb") as log:
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True, env=dict(os.environ, **self.env()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the {self.name} emulator exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.host}{self.ready_path}", timeout=1):
                    LOGGER.info("%s emulator ready at %s (pid %d)", self.name, self.host, self._process.pid)
                    return self
            except urllib.error.HTTPError:
                return self  # it answers: up, even if this path is not a resource
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the {self.name} emulator did not start within {timeout_s:.0f} s")

    def install_hint(self) -> str:
        return "run `make install`"

    def log_tail(self, lines: int = 30) -> str:
        if not self._workdir:
            return ""
        path = Path(self._workdir) / "emulator.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def activate(self) -> None:
        os.environ.update(self.env())

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            terminate_process_group(process, 10)  # the gcloud wrapper's Java child too
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PubSubEmulator(Emulator):
    name = "pubsub"

    def command(self, workdir: str) -> list[str]:
        return ["gcloud", "beta", "emulators", "pubsub", "start", f"--host-port={self.host}",
                f"--data-dir={workdir}", f"--project={self.project}", "--quiet"]

    def install_hint(self) -> str:
        return ("install the Google Cloud CLI with its Pub/Sub emulator (Debian: google-cloud-cli-pubsub-emulator) "
                "and Java")

    def env(self) -> dict[str, str]:
        return {**super().env(), "PUBSUB_EMULATOR_HOST": self.host, "PUBSUB_PROJECT_ID": self.project}

    def topic(self, name: str) -> str:
        return f"projects/{self.project}/topics/{name}"

    def subscription(self, name: str) -> str:
        return f"projects/{self.project}/subscriptions/{name}"

    def create_topic(self, name: str, *, subscription: str | None = None, ordering: bool = False) -> str:
        """Creates a topic (and a subscription to it); returns the topic path."""
        from google.cloud import pubsub_v1

        self.activate()
        topic = self.topic(name)
        pubsub_v1.PublisherClient().create_topic(name=topic)
        if subscription:
            subscriber = pubsub_v1.SubscriberClient()
            subscriber.create_subscription(request={
                "name": self.subscription(subscription), "topic": topic,
                "enable_message_ordering": ordering, "ack_deadline_seconds": 60})
            subscriber.close()
        return topic

    @staticmethod
    def take(subscription: str) -> list[bytes]:
        """Every message waiting in ``subscription`` (the emulator this process is pointed at), acknowledged."""
        from google.cloud import pubsub_v1

        subscriber, found = pubsub_v1.SubscriberClient(), []
        try:
            while True:
                # A waiting message comes back at once; with none, the emulator answers about a second before the
                # deadline: the last, empty pull takes 2 s (it took 9 with a 10 s deadline).
                response = subscriber.pull(subscription=subscription, max_messages=1000, timeout=3)
                if not response.received_messages:
                    return found
                found += [m.message.data for m in response.received_messages]
                subscriber.acknowledge(subscription=subscription,
                                       ack_ids=[m.ack_id for m in response.received_messages])
        finally:
            subscriber.close()


class GcsEmulator(Emulator):
    name = "gcs"
    ready_path = "/storage/v1/b"

    def command(self, workdir: str) -> list[str]:
        return [str(EMULATOR_BIN / "gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(self.port),
                "--in-memory", "--quiet"]

    def env(self) -> dict[str, str]:
        return {**super().env(), "STORAGE_EMULATOR_HOST": f"http://{self.host}"}

    def upload_folder(self, folder: Path, bucket: str, prefix: str) -> str:
        """Uploads every file under ``folder``; returns the gs:// URI of the copy."""
        from pipeline.serving.model_weights import storage_client

        self.activate()
        client = storage_client()
        target = client.bucket(bucket)
        if not target.exists():
            target = client.create_bucket(bucket)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            target.blob(f"{prefix}/{path.relative_to(folder)}").upload_from_filename(str(path))
        return f"gs://{bucket}/{prefix}"


class BigQueryEmulator(Emulator):
    name = "bigquery"
    ready_path = f"/bigquery/v2/projects/{PROJECT}/datasets"

    def command(self, workdir: str) -> list[str]:
        return [str(EMULATOR_BIN / "python"), str(REPO_ROOT / "local" / "bigquery_emulator_offline.py"), "start",
                "--rest-host", "127.0.0.1", "--rest-port", str(self.port),
                "--grpc-port", "0", "--ephemeral", "--project", self.project, "--log-level", "warning"]

    def env(self) -> dict[str, str]:
        return {**super().env(), BIGQUERY_EMULATOR_ENV: f"http://{self.host}"}

    def activate(self) -> None:
        super().activate()
        use_bigquery_emulator()


# Google's BigQuery library, unlike its Pub/Sub and Storage libraries, does not go anonymous for an emulator, and
# Beam's streaming inserts call BigQuery's own address: a local process that writes to the emulator wraps both
# from outside the worker code (use_bigquery_emulator).
BIGQUERY_EMULATOR_ENV = "BIGQUERY_EMULATOR_HOST"


def emulator_bigquery_client(project: str):
    """An anonymous BigQuery client on the emulator this process's environment names."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import bigquery

    return bigquery.Client(project=project, credentials=AnonymousCredentials(),
                           client_options={"api_endpoint": os.environ[BIGQUERY_EMULATOR_ENV]})


def use_bigquery_emulator() -> bool:
    """Points this process's BigQuery clients at the emulator its environment names, if it names one: the sink's
    table checks (``pipeline.sinks.bigquery_sink.bigquery_client``) and Beam's streaming inserts (its
    ``BigQueryWriteFn`` takes a client, its own test seam)."""
    if not os.environ.get(BIGQUERY_EMULATOR_ENV):
        return False
    from apache_beam.io.gcp.bigquery import BigQueryWriteFn

    from pipeline.sinks import bigquery_sink

    bigquery_sink.bigquery_client = emulator_bigquery_client
    if not getattr(BigQueryWriteFn, "_emulator_client", False):
        original = BigQueryWriteFn.start_bundle

        def start_bundle(self) -> None:
            if self.test_client is None:
                self.test_client = emulator_bigquery_client(PROJECT)
            original(self)

        BigQueryWriteFn.start_bundle = start_bundle
        BigQueryWriteFn._emulator_client = True
    return True
