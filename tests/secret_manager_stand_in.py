"""A loopback stand-in for Secret Manager's REST API, holding the Hugging Face token the tests read.

Secret Manager has no emulator; this one answers ``versions:access`` as the API reference documents it
(https://cloud.google.com/secret-manager/docs/reference/rest/v1/projects.secrets.versions/access), and the real
client library (``google-cloud-secret-manager``, REST transport) talks to it.
"""

from __future__ import annotations

import base64

from google.auth.credentials import AnonymousCredentials
from google.cloud import secretmanager

from tests.loopback_api import LoopbackApi

TOKEN = "hf_streamingLLMtestToken0123456789"
SECRET = "projects/my-project/secrets/hf-token/versions/latest"


class SecretManagerStandIn:
    """Answers GET .../versions/V:access with the payload set for that name; 404 otherwise."""

    def __init__(self, secrets: dict[str, str]) -> None:
        self.secrets = secrets
        self.requests: list[str] = []
        self.api = LoopbackApi(self.access)

    def access(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict]:
        name = path.split("?")[0].removeprefix("/v1/").removesuffix(":access")
        self.requests.append(name)
        if method == "GET" and name in self.secrets:
            return 200, {"name": name, "payload": {"data": base64.b64encode(self.secrets[name].encode()).decode()}}
        return 404, {"error": {"code": 404, "message": f"Secret Version [{name}] not found.", "status": "NOT_FOUND"}}

    def client(self) -> secretmanager.SecretManagerServiceClient:
        return secretmanager.SecretManagerServiceClient(
            transport="rest", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.api.url})

    def close(self) -> None:
        self.api.close()
