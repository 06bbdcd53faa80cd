"""The Google Cloud SDK's Pub/Sub emulator on loopback, for smoke runs and tests.

It runs as its own process group (the ``gcloud`` wrapper starts a Java child
that does not always die with it), so :meth:`PubSubEmulator.stop` signals the
group it started and nothing else.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.model_manager import free_port

LOGGER = logging.getLogger(__name__)


class PubSubEmulator:
    def __init__(self, project: str = "local-project", port: int | None = None) -> None:
        self.project = project
        self.port = port or free_port()
        self.host = f"127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self._data_dir: str | None = None
        self._log_path: Path | None = None

    def start(self, timeout_s: float = 90.0) -> PubSubEmulator:
        gcloud = shutil.which("gcloud")
        if gcloud is None:
            raise RuntimeError("gcloud is not on PATH; install the Google Cloud CLI with its "
                               "pubsub-emulator component (Debian: google-cloud-cli-pubsub-emulator)")
        self._data_dir = tempfile.mkdtemp(prefix="pubsub-emulator-")
        self._log_path = Path(self._data_dir) / "emulator.log"
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(
                [gcloud, "beta", "emulators", "pubsub", "start", f"--host-port={self.host}",
                 f"--data-dir={self._data_dir}", f"--project={self.project}", "--quiet"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the Pub/Sub emulator exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.host}/", timeout=1) as response:
                    if response.status == 200:
                        LOGGER.info("Pub/Sub emulator ready at %s", self.host)
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Pub/Sub emulator did not start within {timeout_s:.0f} s")

    def log_tail(self, lines: int = 30) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def env(self) -> dict[str, str]:
        """Variables that point Google's client libraries at this emulator."""
        return {"PUBSUB_EMULATOR_HOST": self.host, "PUBSUB_PROJECT_ID": self.project,
                "GOOGLE_CLOUD_PROJECT": self.project}

    def activate(self) -> None:
        os.environ.update(self.env())

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=10)
                    os.killpg(process.pid, 0)  # Java may outlive the wrapper
                    time.sleep(0.5)
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def topic(self, name: str) -> str:
        return f"projects/{self.project}/topics/{name}"

    def subscription(self, name: str) -> str:
        return f"projects/{self.project}/subscriptions/{name}"

    def create_topic(self, name: str, *, subscription: str | None = None, ordering: bool = False) -> str:
        """Creates a topic (and a subscription to it); returns the topic path."""
        from google.cloud import pubsub_v1

        self.activate()
        publisher = pubsub_v1.PublisherClient()
        topic = self.topic(name)
        publisher.create_topic(name=topic)
        if subscription:
            subscriber = pubsub_v1.SubscriberClient()
            subscriber.create_subscription(request={
                "name": self.subscription(subscription), "topic": topic,
                "enable_message_ordering": ordering, "ack_deadline_seconds": 60})
            subscriber.close()
        return topic

    def __enter__(self) -> PubSubEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
