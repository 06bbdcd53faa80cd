"""A Pub/Sub that misbehaves as the real service does: a gRPC proxy on loopback in front of the real emulator.

The emulator answers every pull with what it holds, at once, and never fails a call. The real service does not
(Pub/Sub's error codes: https://cloud.google.com/pubsub/docs/reference/error-codes; its pull guide:
https://cloud.google.com/pubsub/docs/pull): a unary pull may return fewer messages than exist, or none, before its
deadline (googleapis/python-pubsub#343); calls fail with UNAVAILABLE, INTERNAL or DEADLINE_EXCEEDED and are to be
tried again; an answer can come after the caller's deadline, when the messages it carried are leased to nobody
and come back once their ack deadline passes; acknowledgements and deadline changes fail too ("best effort").
This proxy forwards each call of ``google.pubsub.v1.Subscriber`` and ``Publisher`` to the emulator unchanged,
except that, drawn from one seeded generator, it:

* answers a pull with fewer messages than asked for (``short``: it forwards a smaller ``max_messages``, or none);
* refuses a call with one of ``codes`` before forwarding it (``error``);
* holds an answer ``slow_s`` before returning it (``slow``): past the client's deadline, a pull's messages are
  delivered to no one, as a late answer's are;
* answers a call with UNAVAILABLE after the emulator carried it out (``lost``): a pull's messages are then leased
  to no one, as when an answer is lost on its way back;
* refuses an acknowledgement or a deadline change (``ack_error``, with one of ``ack_codes``), which then never
  reaches the emulator; either may also be slow or lost, as any call.

Clients reach it as they reach the emulator, through ``PUBSUB_EMULATOR_HOST`` (:meth:`FaultProxy.env`). What it
did is counted in ``done``, so a test can say how much went wrong; and what was acknowledged in time is kept by
message (:meth:`FaultProxy.acknowledged`), so a test can say that nothing it ended is left to come back. The
emulator takes an acknowledgement whatever its lease; the service does not promise to honour one that comes after
the ack deadline (https://cloud.google.com/pubsub/docs/lease-management), so here an acknowledgement counts only
for an ack id still leased: pulled within the subscription's ``ack_deadline_s``, or the last deadline a
ModifyAckDeadline gave it.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.pubsub_v1.types import AcknowledgeRequest, ModifyAckDeadlineRequest, PullRequest, PullResponse

SUBSCRIBER = "/google.pubsub.v1.Subscriber/"
ACKS = {SUBSCRIBER + "Acknowledge", SUBSCRIBER + "ModifyAckDeadline"}


@dataclass
class Faults:
    """How often each fault happens (each a probability per call), and what it is made of."""

    short: float = 0.0
    error: float = 0.0
    slow: float = 0.0
    ack_error: float = 0.0
    lost: float = 0.0
    slow_s: float = 2.0
    codes: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                          grpc.StatusCode.DEADLINE_EXCEEDED)
    only: frozenset[str] = frozenset()  # methods the faults apply to ("Pull", ...); all when empty
    # What a refused acknowledgement or deadline change answers: the service's transient refusal by default (the
    # client tries again); PERMISSION_DENIED where a test takes the job's role away.
    ack_codes: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)


@dataclass
class FaultProxy:
    """The proxy: ``upstream`` is the emulator's host:port; ``seed`` draws every fault."""

    upstream: str
    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    done: collections.Counter[str] = field(default_factory=collections.Counter)
    ack_deadline_s: float = 10.0  # the subscriptions' own (Pub/Sub's least, as the tests make them)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._leased: dict[str, bytes] = {}  # ack id -> the data of the message a pull leased under it
        self._lease_ends: dict[str, float] = {}  # ack id -> when its lease ends (monotonic)
        self._acked: set[bytes] = set()  # the data of every message an acknowledgement the emulator carried out named
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(self.upstream)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        self._server.add_generic_rpc_handlers([_Handler(self)])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"PUBSUB_EMULATOR_HOST": self.host}

    def counts(self) -> collections.Counter[str]:
        """A copy of ``done``, taken under the lock its handlers count under."""
        with self._lock:
            return collections.Counter(self.done)

    def acknowledged(self) -> set[bytes]:
        """The data of every message that an acknowledgement carried out by the emulator named while its lease ran
        (its answer may have been lost on the way back: ``lost``)."""
        with self._lock:
            return set(self._acked)

    def close(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()

    def _draw(self, method: str) -> dict[str, Any]:
        name = method.rsplit("/", 1)[-1]
        with self._lock:
            if self.faults.only and name not in self.faults.only:
                return {}
            drawn: dict[str, Any] = {}
            if method in ACKS:
                if self._rng.random() < self.faults.ack_error:
                    drawn["code"] = self._rng.choice(self.faults.ack_codes)
            elif self._rng.random() < self.faults.error:
                drawn["code"] = self._rng.choice(self.faults.codes)
            elif name == "Pull" and self._rng.random() < self.faults.short:
                drawn["fewer"] = self._rng.random()
            if self._rng.random() < self.faults.slow:
                drawn["slow_s"] = self.faults.slow_s
            if "code" not in drawn and self._rng.random() < self.faults.lost:
                drawn["lost"] = True
            return drawn

    def forward(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        drawn = self._draw(method)
        if "code" in drawn:
            with self._lock:
                self.done[f"{method.rsplit('/', 1)[-1]} {drawn['code'].name}"] += 1
            context.abort(drawn["code"], "injected by the fault proxy")
        if "fewer" in drawn:
            pull = PullRequest.deserialize(request)
            pull.max_messages = int(pull.max_messages * drawn["fewer"])
            with self._lock:
                self.done["Pull short"] += 1
            if pull.max_messages == 0:
                time.sleep(min(1.0, (context.time_remaining() or 1.0) / 2))  # an empty answer, after a while
                return b""  # an empty PullResponse
            request = PullRequest.serialize(pull)
        # The caller's deadline goes upstream, as gRPC propagates it: a pull the caller gave up on is not left
        # waiting at the emulator to lease what comes later to no one (that is the "slow" fault's to do).
        answer = self._channel.unary_unary(method)(request, timeout=context.time_remaining() or 30)
        self._record(method, request, answer)
        if "slow_s" in drawn:
            with self._lock:
                self.done[f"{method.rsplit('/', 1)[-1]} slow"] += 1
            time.sleep(drawn["slow_s"])
        if drawn.get("lost"):
            with self._lock:
                self.done[f"{method.rsplit('/', 1)[-1]} lost"] += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "the answer was lost (the fault proxy)")
        return answer


    def _record(self, method: str, request: bytes, answer: bytes) -> None:
        """What the emulator carried out: the messages a pull leased, and those an acknowledgement named."""
        now = time.monotonic()
        if method == SUBSCRIBER + "Pull":
            leased = {m.ack_id: m.message.data for m in PullResponse.deserialize(answer).received_messages}
            with self._lock:
                self._leased.update(leased)
                self._lease_ends.update(dict.fromkeys(leased, now + self.ack_deadline_s))
        elif method == SUBSCRIBER + "ModifyAckDeadline":
            modify = ModifyAckDeadlineRequest.deserialize(request)
            with self._lock:
                for ack_id in modify.ack_ids:
                    if self._lease_ends.get(ack_id, float("-inf")) >= now:  # an ended lease is not extended
                        self._lease_ends[ack_id] = now + modify.ack_deadline_seconds
        elif method == SUBSCRIBER + "Acknowledge":
            ack_ids = AcknowledgeRequest.deserialize(request).ack_ids
            with self._lock:
                for ack_id in ack_ids:
                    if ack_id not in self._leased:
                        continue
                    if self._lease_ends[ack_id] >= now:
                        self._acked.add(self._leased[ack_id])
                    else:
                        self.done["Acknowledge after its lease"] += 1


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: FaultProxy) -> None:
        self._proxy = proxy

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if not method.startswith(("/google.pubsub.v1.", "/google.iam.v1.")):
            return None
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context, method=method: self._proxy.forward(method, request, context))
