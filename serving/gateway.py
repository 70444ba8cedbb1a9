"""The user-facing gateway: OpenAI-compatible completions and chat completions over the serving
replicas, whole or streamed.

- Balances over the replicas in rotation (least requests in flight); a replica that fails
  to answer (unreachable, 5xx) is retried on another one, so a replica dying or pausing for an
  update does not fail the user's request. The turns of one agent session stay on the replica
  that served the session last while it is in rotation (session affinity): one policy version
  for the whole session (a canary is judged on sessions it served from start to end) and the
  engine's prefix cache holds the conversation so far.
- ``candidates: K`` (or ``n: K``) asks for a candidate group: K samples from one replica, one
  policy version, each choice with its own ``session_id`` and ``candidate_index``, and a
  ``group_id`` on the response.
- Every response carries ``policy_version`` (the version the engine reports in
  ``system_fingerprint``, else the one the registry records for the replica) and the header
  ``x-undertow-policy-version``.
- Every choice is emitted as ``session.completed`` (token ids, logprobs, routed experts) through
  :class:`serving.telemetry.TelemetryEmitter`, off the request path; chat turns of one agent
  session (``x-session-id``) are linked turn by turn (:mod:`serving.turns`).
- ``stream: true`` relays the engine's server-sent events (:mod:`serving.relay`); a replica that
  fails before its first chunk is replaced, and a client that leaves closes the engine's stream,
  which stops the generation. Telemetry records what was served, with ``abort`` then.
- Errors come in OpenAI's shape and are counted by type in ``/gateway/metrics``.
- Every request body is capped while it streams in (:mod:`serving.limits`, ``max_body_bytes``: 413).
- While Kafka is down telemetry goes to a disk spool sized in hours of traffic; when it is full,
  signals are refused and new completions too (503 with ``Retry-After``, ``TelemetryBackPressure``)
  rather than served with telemetry that would be lost (:mod:`serving.telemetry`).
- ``POST /v1/signals``: an editor's signal (accept/reject, retention, selection, switch,
  thumbs, ...) is validated against the wire schema, checked by :mod:`serving.trust` (not dated
  in the future, from the session's own user, each ``event_id`` once) and forwarded to Kafka.
- ``GET /gateway/metrics``: per-version request counts, error rates, latency (also over the stretch of
  time since each newer version's first request, :func:`paired_latency`) and the acceptance proxy,
  which the deployer's gate reads. In it, one user's signals count at most
  ``gate_signals_per_user`` times per version and the most extreme users are trimmed
  (``gate_trim_users``): a handful of accounts cannot carry the gate. A multi-turn session whose
  turns several versions served (a canary rolled back mid-session) judges none of them
  (``unjudged``).
- Clients authenticate with an API key per client integration (:mod:`serving.keys`; ``Authorization:
  Bearer ugw_...``, what the ``openai`` SDK sends as ``api_key``), unless the gateway is built
  without a key ring. Each client and each user has a rate (:mod:`serving.ratelimit`); beyond it,
  429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import statistics
import time
import uuid
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
import httpx
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, ValidationError
from sqlalchemy.engine import Engine
from starlette.types import ASGIApp, Receive, Scope, Send

from serving import relay, turns
from serving.chat import malformed_tool_call
from serving.client import EngineClient, EngineError, error_message
from serving.config import FleetConfig, GatewayConfig
from serving.engine import openai_error, validation_message
from serving.fleet import Replica
from serving.keys import ClientKey, KeyRing
from serving.limits import BodyLimit
from serving.protocol import ChatCompletionRequest, CompletionRequest
from serving.ratelimit import Buckets
from serving.telemetry import TelemetryEmitter
from serving.trust import MIXED, Refusal, SignalTrust, remember
from serving.turns import MAX_SESSION_ID

log = structlog.get_logger(__name__)

ReplicaSource = Callable[[], Awaitable[list[Replica]]]
"""Returns the replicas in rotation (static list, or the registry)."""

ACCEPT_TYPES = {"edit.accepted": 1.0, "edit.rejected": 0.0}
MAX_COUNTED_SESSIONS = 100_000
"""Distinct judged sessions remembered per version and kind; beyond, each signal counts as a session
(the gate's standard errors are tiny by then anyway)."""
OPEN = ClientKey("anonymous", ("serve", "metrics"))
"""Who calls a gateway built without a key ring (tests, a development stack)."""
STREAM_BROKEN = (
    b'data: {"error":{"message":"the engine stream broke; retry the request","type":"BadGatewayError","code":502}}\n\n'
)


class GatewayRequest(CompletionRequest):
    """A user's completion request: the engine's fields plus Undertow's."""

    model_config = ConfigDict(extra="ignore")

    user: str | None = Field(default=None, max_length=128)
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_SESSION_ID)
    candidates: int | None = Field(default=None, ge=1)


class GatewayChatRequest(ChatCompletionRequest):
    """A user's chat request: OpenAI's fields plus Undertow's session link and candidate groups."""

    model_config = ConfigDict(extra="ignore")

    user: str | None = Field(default=None, max_length=128)
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_SESSION_ID)
    metadata: dict[str, Any] | None = None
    candidates: int | None = Field(default=None, ge=1)

    def linked_session(self, header: str | None) -> str | None:
        """The agent session this turn belongs to: header, then ``session_id``, then metadata."""
        meta = (self.metadata or {}).get("session_id")
        return header or self.session_id or (str(meta) if meta is not None else None)


def static_replicas(urls: list[str], version: str | None = None) -> ReplicaSource:
    """A fixed replica list (no registry)."""
    reps = [Replica(f"r{i}", u, "default", "local", "cpu", "serving", version, None, "ok") for i, u in enumerate(urls)]

    async def source() -> list[Replica]:
        return reps

    return source


@dataclass
class VersionStats:
    """Online metrics of one policy version (what the deployment gate compares).

    The acceptance is robust to a few users: each user's signals are averaged first, and a user
    weighs ``min(signals, per_user_cap)`` (one account sending many signals weighs no more than
    ``cap`` honest ones); then the ``trim`` share of users with the highest means and the same share
    with the lowest (at least one each, from five users on; among users tied at an extreme, the
    heaviest first) are left out. ``per_user_cap`` 0 gives
    the plain mean of all signals.
    """

    requests: int = 0
    errors: int = 0
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    served_at: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    """When each of ``latencies_ms`` ended (``time.monotonic()``), so that two versions' latencies can be
    compared over the same stretch of time (:func:`paired_latency`)."""
    accepts: float = 0.0
    judged: int = 0
    per_user: dict[str, list[float]] = field(default_factory=dict)
    per_user_cap: int = 0
    trim: float = 0.05
    by_kind: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Signals by the kind of traffic they judge (``agent``: multi-turn sessions; ``single``: one
    request), per user as ``per_user``: acceptance differs by kind far more than between versions,
    so the gate also compares the kinds apart (:func:`serving.deploy.stratified_drop`), each with
    the same robust mean."""

    answers: int = 0
    """Choices served (every choice of every request, streamed or whole)."""
    truncated: int = 0
    """Choices that ended at the token limit (``finish_reason`` ``length``): a version whose answers
    degenerate into repetition shows it here on every request, long before any user judges it."""
    malformed_tool_calls: int = 0
    """Chat answers with a tool call no parser could read (:func:`serving.chat.malformed_tool_call`):
    like the cut answers, a broken version shows it on every turn before any user judges it."""
    answer_tokens: deque[int] = field(default_factory=lambda: deque(maxlen=2000))
    """Tokens of the latest answers whose token ids the engine returned: a version whose answers turn a
    fraction (or a multiple) of the usual length is broken, whatever users have judged yet."""
    sessions: dict[str, set[str]] = field(default_factory=dict)
    """Judged session ids by kind (up to :data:`MAX_COUNTED_SESSIONS` each, then counted in
    ``sessions_over``): one session's signals (an accept and its retention at three horizons) are one
    observation, not four, so the gate's standard errors count sessions."""
    sessions_over: dict[str, int] = field(default_factory=dict)

    def judge(self, user: str | None, value: float, kind: str = "single", session_id: str | None = None) -> None:
        """Count one acceptance signal of ``user`` (None: a user the gateway does not know) on traffic of
        ``kind``, about ``session_id`` (None: counted as a session of its own)."""
        self.accepts += value
        self.judged += 1
        seen = self.sessions.setdefault(kind, set())
        if session_id is None or (session_id not in seen and len(seen) >= MAX_COUNTED_SESSIONS):
            self.sessions_over[kind] = self.sessions_over.get(kind, 0) + 1
        else:
            seen.add(session_id)
        entry = self.per_user.setdefault(user or "", [0.0, 0.0])
        entry[0] += value
        entry[1] += 1
        stratum = self.by_kind.setdefault(kind, {}).setdefault(user or "", [0.0, 0.0])
        stratum[0] += value
        stratum[1] += 1

    def acceptance(self) -> float | None:
        """The robust acceptance (see the class docstring); the plain mean when the cap is off."""
        return self._robust(self.per_user)

    def _robust(self, per_user: dict[str, list[float]]) -> float | None:
        judged = sum(count for _, count in per_user.values())
        if not judged:
            return None
        if self.per_user_cap <= 0:
            return sum(total for total, _ in per_user.values()) / judged
        users = [(total / count, min(count, self.per_user_cap)) for total, count in per_user.values()]
        k = max(1, math.floor(self.trim * len(users))) if len(users) >= 5 else 0
        if k:  # among users tied at an extreme, the heaviest go first
            users = sorted(users, key=lambda u: (u[0], -u[1]))[k:]
            users = sorted(users, key=lambda u: (u[0], u[1]))[:-k]
        return sum(mean * w for mean, w in users) / sum(w for _, w in users)

    def _sessions(self, kind: str) -> int:
        return len(self.sessions.get(kind, ())) + self.sessions_over.get(kind, 0)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": self.errors / self.requests if self.requests else 0.0,
            "latency_ms_p50": lat[len(lat) // 2] if lat else None,
            "answers": self.answers,
            "truncation_rate": self.truncated / self.answers if self.answers else None,
            "malformed_tool_call_rate": self.malformed_tool_calls / self.answers if self.answers else None,
            **_length_summary(self.answer_tokens),
            "acceptance": self.acceptance(),
            "acceptance_raw": self.accepts / self.judged if self.judged else None,
            "judged": self.judged,
            "judged_sessions": sum(self._sessions(kind) for kind in self.by_kind),
            "judged_users": len(self.per_user),
            "by_kind": {
                kind: {
                    "acceptance": self._robust(users),
                    "judged": int(sum(n for _, n in users.values())),
                    "judged_sessions": self._sessions(kind),
                }
                for kind, users in self.by_kind.items()
            },
        }


def _length_summary(tokens: deque[int]) -> dict[str, float | int | None]:
    """Mean, standard deviation (ddof 1) and count of answer lengths in tokens (None without answers)."""
    n = len(tokens)
    return {
        "answer_tokens_mean": statistics.fmean(tokens) if n else None,
        "answer_tokens_sd": statistics.stdev(tokens) if n > 1 else None,
        "answer_tokens_n": n,
    }


class Gateway:
    """Balancing, candidate groups, sessions, streaming, version tagging, telemetry and metrics
    (the app wraps this)."""

    def __init__(
        self,
        source: ReplicaSource,
        emitter: TelemetryEmitter | None,
        config: GatewayConfig,
        model_name: str,
        keys: KeyRing | None = None,
    ) -> None:
        self.source = source
        self.emitter = emitter
        self.config = config
        self.model_name = model_name
        self.keys = keys
        self.http = httpx.AsyncClient(timeout=config.request_timeout_s, limits=httpx.Limits(max_connections=256))
        self.inflight: dict[str, int] = defaultdict(int)
        self.stats: dict[str, VersionStats] = defaultdict(
            lambda: VersionStats(per_user_cap=config.gate_signals_per_user, trim=config.gate_trim_users)
        )
        self.errors: Counter[str] = Counter()
        self.unjudged: Counter[str] = Counter()
        """Acceptance signals that judge no version (``mixed_versions``: the session had turns from several)."""
        self.trust = SignalTrust(config.signal_max_skew_s)
        self.client_rate = Buckets(config.client_rate_per_s, config.client_burst)
        self.user_rate = Buckets(config.user_rate_per_s, config.user_burst)
        self.signal_rate = Buckets(config.user_signal_rate_per_s, config.user_signal_burst)
        self._rr = itertools.count()
        self.affinity: OrderedDict[str, str] = OrderedDict()
        """Agent session -> the replica that served its last turn (most recent last, bounded)."""
        self.multi_turn: OrderedDict[str, str] = OrderedDict()
        """Agent sessions and their turns' ids, each mapped to its agent session's id (to judge their
        signals apart, and count a turn's signals for its session)."""

    async def authorize(self, authorization: str | None, scope: str) -> ClientKey | JSONResponse:
        """The client behind a request's ``Authorization`` header, or the refusal to send (401, 403, 429)."""
        if self.keys is None:
            return OPEN
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return self.fail(
                401,
                "missing API key: send Authorization: Bearer <key> (ask an operator for a gateway key)",
                "AuthenticationError",
            )
        client = await self.keys.lookup(key.strip())
        if client is None:
            return self.fail(401, "unknown or revoked API key", "AuthenticationError")
        if scope not in client.scopes:
            return self.fail(403, f"key {client.name} lacks the {scope!r} scope", "PermissionDeniedError")
        wait = self.client_rate.take(client.name, client.rate_per_s)
        if wait:
            return self.limited(wait, f"client {client.name} is over its rate")
        return client

    def limited(self, wait_s: float, why: str) -> JSONResponse:
        """A 429 with ``Retry-After``, counted as ``RateLimitError``."""
        response = self.fail(429, f"{why}; retry in {wait_s:.1f} s", "RateLimitError")
        response.headers["retry-after"] = Buckets.retry_after(wait_s)
        return response

    def telemetry_full(self, kind: str) -> JSONResponse | None:
        """A 503 with ``Retry-After`` when the telemetry spool cannot keep an event of type ``kind`` (Kafka
        down for longer than the spool holds, see :mod:`serving.telemetry`), else None. For
        ``session.completed`` only under ``spool_full_policy = "backpressure"``."""
        if self.emitter is None or self.emitter.admits(kind):
            return None
        if kind == "session.completed" and self.config.spool_full_policy != "backpressure":
            return None
        return self._telemetry_refusal(kind)

    def _telemetry_refusal(self, kind: str) -> JSONResponse:
        wait = self.config.backpressure_retry_after_s
        response = self.fail(
            503,
            f"telemetry is buffered on disk while Kafka is unreachable and the buffer is full; {kind} is not "
            f"taken now, retry in {wait:.0f} s",
            "TelemetryBackPressure",
        )
        response.headers["retry-after"] = Buckets.retry_after(wait)
        return response

    def refuse(self, refusal: Refusal) -> JSONResponse:
        """A trust refusal as an error answer, counted by its kind."""
        return self.fail(refusal.status, refusal.message, refusal.kind)

    def _user(self, client: ClientKey, named: str | None, session: str | None) -> str | JSONResponse | None:
        """The user a request is served to: the key's own user, else the one the body names; refused
        when the body names another user than the key's, the session belongs to another user, or
        the user is over their rate."""
        user = named
        if client.user_id is not None:
            if named not in (None, client.user_id):
                return self.fail(
                    403, f"this key speaks for user {client.user_id} only, not {named}", "PermissionDeniedError"
                )
            user = client.user_id
        refusal = self.trust.claim(session, user)
        if refusal is not None:
            return self.refuse(refusal)
        if user is not None:
            wait = self.user_rate.take(f"{client.name}\x00{user}")
            if wait:
                return self.limited(wait, f"user {user} is over their request rate")
        return user

    async def pick(self, exclude: set[str], session: str | None = None) -> Replica | None:
        """The replica for the next try: the session's own while it is in rotation, else the one with
        the fewest requests in flight (ties in rotation)."""
        reps = [r for r in await self.source() if r.id not in exclude]
        if not reps:
            return None
        held = self.affinity.get(session) if session is not None else None
        own = next((r for r in reps if r.id == held), None)
        if own is not None:
            return own
        offset = next(self._rr)
        order = sorted(range(len(reps)), key=lambda i: (self.inflight[reps[i].id], (i + offset) % len(reps)))
        return reps[order[0]]

    def _stick(self, session: str | None, rep: Replica) -> None:
        """Remember that ``rep`` served ``session`` (its next turn goes there while it is in rotation)."""
        if session is not None:
            remember(self.affinity, session, rep.id)

    async def _replicas(self, session: str | None = None) -> AsyncIterator[Replica]:
        """Replicas to try for one request, each at most once: the first, then one per retry."""
        tried: set[str] = set()
        for _ in range(self.config.retries + 1):
            rep = await self.pick(tried, session)
            if rep is None:
                return
            tried.add(rep.id)
            yield rep

    def fail(self, status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
        """An error in OpenAI's shape, counted by kind."""
        self.errors[kind] += 1
        return openai_error(status, message, kind)

    async def complete(
        self, req: GatewayRequest, session_header: str | None = None, client: ClientKey = OPEN
    ) -> Response:
        """``/v1/completions``: one user request, whole or streamed (its session id from the body,
        else the ``x-session-id`` header)."""
        k = req.candidates or req.n
        if k > self.config.max_candidates:
            return self.fail(400, f"candidates/n {k} exceeds the gateway's limit of {self.config.max_candidates}")
        if isinstance(req.prompt, str) and len(req.prompt) > self.config.max_prompt_chars:
            return self.fail(
                400, f"prompt is {len(req.prompt)} characters; the limit is {self.config.max_prompt_chars}"
            )
        full = self.telemetry_full("session.completed")
        if full is not None:
            return full
        body = req.model_dump(exclude={"user", "session_id", "candidates", "model"}, exclude_none=True)
        body.update(n=k, return_token_ids=True, logprobs=req.logprobs or 0)
        session = req.session_id or session_header
        if session is not None and not 0 < len(session) <= turns.MAX_SESSION_ID:
            return self.fail(400, f"a session id is 1 to {turns.MAX_SESSION_ID} characters")
        user = self._user(client, req.user, session)
        if isinstance(user, JSONResponse):
            return user
        base, _, group_id = turns.link(session, None, k)
        served = turns.Request(
            model=self.model_name,
            user=user,
            client=client.name,
            sampling=self._sampling(req.temperature, req.top_p, req.max_tokens, req.seed),
            prompt_text=req.prompt if isinstance(req.prompt, str) else None,
            prompt_token_ids=None if isinstance(req.prompt, str) else list(req.prompt),
            base_id=base,
            group_id=group_id,
        )
        wants = relay.Wants(token_ids=req.return_token_ids, logprobs=req.logprobs is not None)
        if req.stream:
            return await self._stream("/v1/completions", body, served, k, chat=False, wants=wants)
        return await self._whole("/v1/completions", body, served, k, chat=False, wants=wants)

    async def chat(
        self,
        req: GatewayChatRequest,
        session_header: str | None,
        client: ClientKey = OPEN,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """``/v1/chat/completions``: one turn of a (possibly multi-turn) session, whole or streamed
        (``headers``: the request's, for the turn index and session group a client may send)."""
        k = req.candidates or req.n
        if k > self.config.max_candidates:
            return self.fail(400, f"candidates/n {k} exceeds the gateway's limit of {self.config.max_candidates}")
        chars = sum(len(m.text()) for m in req.messages)
        if chars > self.config.max_prompt_chars:
            return self.fail(400, f"the messages hold {chars} characters; the limit is {self.config.max_prompt_chars}")
        full = self.telemetry_full("session.completed")
        if full is not None:
            return full
        session = req.linked_session(session_header)
        if session is not None and not 0 < len(session) <= turns.MAX_SESSION_ID:
            return self.fail(400, f"a session id is 1 to {turns.MAX_SESSION_ID} characters")
        user = self._user(client, req.user, session)
        if isinstance(user, JSONResponse):
            return user
        try:
            turn_index = turns.explicit_turn((headers or {}).get(turns.TURN_HEADER), req.metadata)
            group = turns.session_group((headers or {}).get(turns.GROUP_HEADER), req.metadata)
        except ValueError as exc:
            return self.fail(400, str(exc))
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        body = req.model_dump(
            exclude={"user", "session_id", "candidates", "metadata", "model"}, exclude_none=True, mode="json"
        )
        body.update(n=k, return_token_ids=True, logprobs=True, top_logprobs=req.top_logprobs or 0)
        base, turn, group_id = turns.link(session, messages, k, turn_index)
        served = turns.Request(
            model=self.model_name,
            user=user,
            client=client.name,
            sampling=self._sampling(req.temperature, req.top_p, req.limit(), req.seed),
            prompt_text=turns.conversation_text(messages),
            messages=messages,
            session=session,
            turn=turn,
            session_group=group if session is not None else None,
            base_id=base,
            group_id=group_id,
        )
        wants = relay.Wants(token_ids=req.return_token_ids, logprobs=req.logprobs)
        if req.stream:
            return await self._stream("/v1/chat/completions", body, served, k, chat=True, wants=wants)
        return await self._whole("/v1/chat/completions", body, served, k, chat=True, wants=wants)

    @staticmethod
    def _sampling(temperature: float, top_p: float, max_tokens: int | None, seed: int | None) -> dict[str, Any]:
        return {
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "seed": seed,
            "logprobs_mode": "raw",
        }

    async def _whole(
        self, path: str, body: dict[str, Any], req: turns.Request, k: int, *, chat: bool, wants: relay.Wants
    ) -> Response:
        last: EngineError | None = None
        async for rep in self._replicas(req.session):
            start = time.perf_counter()
            self.inflight[rep.id] += 1
            try:
                data = await EngineClient(rep.url, client=self.http).post_json(path, body)
            except EngineError as exc:
                last = exc
                if 400 <= exc.status < 500 and exc.status != 409:
                    return self.fail(exc.status, exc.message, _kind(exc.status))
                self.stats[rep.version or "unknown"].errors += 1
                continue
            finally:
                self.inflight[rep.id] -= 1
            req.latency_ms = (time.perf_counter() - start) * 1000
            self._stick(req.session, rep)
            req.version = data.get("system_fingerprint") or rep.version or "unknown"
            self._count(req.version, req.latency_ms)
            self._shape(req, data, k, chat=chat, wants=wants)
            return JSONResponse(data, headers=self._headers(req))
        return self._unavailable(last)

    def _unavailable(self, last: EngineError | None) -> JSONResponse:
        if last is None:
            return self.fail(503, "no serving replica is in rotation; retry shortly", "ServiceUnavailableError")
        return self.fail(502, f"no replica could serve the request (last: {last})", "BadGatewayError")

    def _count(self, version: str, latency_ms: float) -> None:
        stats = self.stats[version]
        stats.requests += 1
        stats.latencies_ms.append(latency_ms)
        stats.served_at.append(time.monotonic())

    def _headers(self, req: turns.Request) -> dict[str, str]:
        headers = {"x-undertow-policy-version": req.version, "x-undertow-session-id": req.base_id}
        if req.group_id:
            headers["x-undertow-group-id"] = req.group_id
        return headers

    def _shape(self, req: turns.Request, data: dict[str, Any], k: int, *, chat: bool, wants: relay.Wants) -> None:
        if chat:
            req.prompt_token_ids = (
                data.get("prompt_token_ids") if wants.token_ids else data.pop("prompt_token_ids", None)
            )
        for choice in data["choices"]:
            idx = int(choice["index"])
            served = _served(choice, chat)
            if not chat and choice.get("prompt_token_ids") is not None:
                req.prompt_token_ids = choice["prompt_token_ids"]
            choice["session_id"] = req.session_id(idx, k)
            if req.group_id:
                choice["candidate_index"] = idx
            if not wants.token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
                if chat:
                    choice.pop("routed_experts", None)
            if not wants.logprobs:
                choice["logprobs"] = None
            self._emit(req, served, k)
        data["policy_version"] = req.version
        data["model"] = self.model_name
        if req.group_id:
            data["group_id"] = req.group_id

    def _emit(self, req: turns.Request, served: turns.Served, k: int) -> None:
        stats = self.stats[req.version]
        stats.answers += 1
        stats.truncated += served.finish_reason == "length"
        stats.malformed_tool_calls += req.messages is not None and malformed_tool_call(served.text)
        if served.token_ids or not served.text:  # an engine that returned no token ids: length unknown
            stats.answer_tokens.append(len(served.token_ids))
        session_id = req.session_id(served.index, k)
        self.trust.served(session_id, req.version, req.user, req.client)
        if req.session is not None:
            self.trust.served(req.session, req.version, req.user, req.client)
            remember(self.multi_turn, req.session, req.session)
            remember(self.multi_turn, session_id, req.session)
        if self.emitter is not None:
            self.emitter.emit(turns.event(req, served, k))

    async def _stream(
        self, path: str, body: dict[str, Any], req: turns.Request, k: int, *, chat: bool, wants: relay.Wants
    ) -> Response:
        body = {**body, "stream": True}
        last: EngineError | None = None
        async for rep in self._replicas(req.session):
            start = time.perf_counter()
            try:
                response = await self.http.send(
                    self.http.build_request("POST", rep.url.rstrip("/") + path, json=body), stream=True
                )
            except httpx.TransportError as exc:
                last = EngineError(rep.url, 0, f"unreachable ({exc.__class__.__name__})")
                self.stats[rep.version or "unknown"].errors += 1
                continue
            if response.status_code != 200:
                await response.aread()
                await response.aclose()
                last = EngineError(rep.url, response.status_code, error_message(response))
                if 400 <= response.status_code < 500 and response.status_code != 409:
                    return self.fail(response.status_code, last.message, _kind(response.status_code))
                self.stats[rep.version or "unknown"].errors += 1
                continue
            stream = relay.Relay(
                response,
                response.aiter_lines(),
                chat=chat,
                wants=wants,
                model=self.model_name,
                session_id=lambda i: req.session_id(i, k),
            )
            try:
                first = await stream.first()
            except (httpx.TransportError, ValueError) as exc:
                await stream.close()
                last = EngineError(rep.url, 0, f"stream broke before its first chunk ({exc.__class__.__name__})")
                self.stats[rep.version or "unknown"].errors += 1
                continue
            req.version = stream.version or rep.version or "unknown"
            self._stick(req.session, rep)
            self.inflight[rep.id] += 1
            return StreamingResponse(
                self._relay(stream, first, req, k, rep, start),
                media_type="text/event-stream",
                headers={**self._headers(req), "cache-control": "no-cache"},
            )
        return self._unavailable(last)

    async def _relay(
        self, stream: relay.Relay, first: bytes | None, req: turns.Request, k: int, rep: Replica, start: float
    ) -> AsyncIterator[bytes]:
        broken = False
        try:
            if first is not None:
                yield first
            if not stream.finished:
                async for chunk in stream.rest():
                    yield chunk
        except httpx.TransportError:
            broken = True
            self.stats[req.version].errors += 1
            self.errors["EngineStreamBroken"] += 1
            yield STREAM_BROKEN
        finally:
            self.inflight[rep.id] -= 1
            if not stream.finished and not broken:
                self.errors["ClientAbandonedStream"] += 1
            # Shielded: a client that hangs up once it has read [DONE] (the openai SDK does) cancels this
            # response while the engine's stream is being closed, and the served turn lost its telemetry.
            with anyio.CancelScope(shield=True):
                served = await stream.close()
            req.latency_ms = (time.perf_counter() - start) * 1000
            req.prompt_token_ids = stream.prompt_token_ids or req.prompt_token_ids
            self._count(req.version, req.latency_ms)
            for item in served:
                self._emit(req, item, k)

    def signal(self, raw: dict[str, Any], client: ClientKey = OPEN) -> JSONResponse:
        """Validate one signal envelope (event_id/occurred_at filled when absent), check that it can be
        trusted (:mod:`serving.trust`), that its user is within their signal rate, and forward it once."""
        from ingest.schemas import InvalidEvent, validate_event

        if raw.get("type") == "session.completed":
            return self.fail(400, "session.completed is emitted by the gateway itself; send signals only")
        raw.setdefault("schema_version", 1)
        raw.setdefault("event_id", str(uuid.uuid4()))
        raw.setdefault("occurred_at", datetime.now(UTC).isoformat())
        try:
            event = validate_event(raw)
        except InvalidEvent as exc:
            return self.fail(422, f"invalid signal ({exc.reason}): {exc.detail}", "InvalidSignal")
        if self.trust.duplicate(event.event_id):
            self.errors["DuplicateSignal"] += 1
            return JSONResponse({"accepted": True, "duplicate": True, "event_id": event.event_id})
        named = self.keys is not None
        refusal = self.trust.check(
            raw, event.occurred_at, client=client.name if named else None, key_user=client.user_id
        )
        if refusal is not None:
            return self.refuse(refusal)
        if raw.get("user_id") != event.user_id:  # the served user, filled in by the check
            event = validate_event(raw)
        wait = self.signal_rate.take(f"{client.name}\x00{event.user_id}") if event.user_id else 0.0
        if wait:
            return self.limited(wait, f"user {event.user_id} is over their signal rate")
        if self.emitter is not None and not self.emitter.emit(event.model_dump(mode="json", exclude_none=True)):
            return self._telemetry_refusal(event.type)  # shed, counted; not remembered: the client may send it again
        self.trust.accepted(event.event_id)
        self._score(event.type, event.session_id, event.payload.model_dump())
        return JSONResponse({"accepted": True, "event_id": event.event_id}, status_code=202)

    def _score(self, kind: str, session_id: str | None, payload: dict[str, Any]) -> None:
        version = self.trust.version(session_id)
        if version is None or session_id is None:
            return
        if version == MIXED:  # e.g. a session a rolled-back canary wrote part of: it judges neither version
            self.unjudged["mixed_versions"] += 1
            return
        value: float | None = ACCEPT_TYPES.get(kind)
        if kind == "feedback.thumbs":
            value = 1.0 if payload.get("value") == 1 else 0.0
        elif kind == "code.retained" and payload.get("lines_written"):
            value = payload["lines_retained"] / payload["lines_written"]
        if value is not None:
            agent = self.multi_turn.get(session_id)  # a signal on a turn is about its agent session
            kind = "agent" if agent is not None else "single"
            self.stats[version].judge(self.trust.owner(session_id), value, kind, agent or session_id)

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "versions": {v: {**s.summary(), **paired_latency(v, self.stats)} for v, s in self.stats.items()},
            "errors": dict(self.errors),
            "unjudged": dict(self.unjudged),
        }
        if self.emitter is not None:
            out["telemetry"] = self.emitter.snapshot()
        return out


def paired_latency(version: str, stats: dict[str, VersionStats]) -> dict[str, Any]:
    """``{"latency_ms_p50_since": {newer: {"p50": ms, "n": count}}}``: the p50 latency of ``version``'s
    requests that ended since each version that began serving after it served its first retained request,
    where there were any.

    A canary's latencies all come from its own stage, while the current version's reach back to calm
    hours; on a machine where an update trains beside the engines, the canary's stage is the loaded
    one, and comparing the two p50s as they are blames the new version for the load. The deployer
    compares the canary with the current version's requests of the same stretch of time
    (:func:`serving.deploy.same_window`). The times are in completion order, so each window is a
    suffix found by bisection: a version that stopped serving before the newer one began costs nothing."""
    own = stats[version]
    if not own.served_at:
        return {}
    first, last = own.served_at[0], own.served_at[-1]
    starts = {
        other: theirs.served_at[0]
        for other, theirs in stats.items()
        if other != version and theirs.served_at and first < theirs.served_at[0] <= last
    }
    if not starts:  # no newer version served while this one did: nothing copied or sorted
        return {}
    served_at, latencies = list(own.served_at), list(own.latencies_ms)
    since: dict[str, dict[str, float | int]] = {}
    for other, start in starts.items():
        window = sorted(latencies[bisect.bisect_left(served_at, start) :])
        since[other] = {"p50": window[len(window) // 2], "n": len(window)}
    return {"latency_ms_p50_since": since}


def _kind(status: int) -> str:
    return {404: "NotFoundError", 413: "RequestTooLarge", 429: "RateLimitError"}.get(status, "BadRequestError")


def _served(choice: dict[str, Any], chat: bool) -> turns.Served:
    """What one choice of a whole answer served."""
    logprobs = choice.get("logprobs") or {}
    if chat:
        message = choice.get("message") or {}
        values = [float(item["logprob"]) for item in logprobs.get("content") or []]
        text, calls = message.get("content") or "", list(message.get("tool_calls") or [])
    else:
        values = [float(x) for x in logprobs.get("token_logprobs") or []]
        text, calls = choice.get("text", ""), []
    return turns.Served(
        index=int(choice["index"]),
        text=text,
        token_ids=list(choice.get("token_ids") or []),
        logprobs=values,
        routed_experts=choice.get("routed_experts"),
        finish_reason=choice.get("finish_reason"),
        tool_calls=calls,
    )


def create_gateway_app(gateway: Gateway, background: list[Callable[[], Awaitable[None]]] | None = None) -> FastAPI:
    """The gateway's FastAPI app; ``background`` coroutines (health checks) run while it serves."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        tasks = [asyncio.ensure_future(job()) for job in background or []]
        yield
        for task in tasks:
            task.cancel()
        await gateway.http.aclose()
        if gateway.emitter is not None:
            await asyncio.to_thread(gateway.emitter.close)

    app = FastAPI(title="Undertow gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    limit = gateway.config.max_body_bytes

    def too_large(limit: int) -> Response:
        return gateway.fail(
            413, f"request body is larger than the limit of {limit} bytes; send a shorter prompt", "RequestTooLarge"
        )

    app.add_middleware(BodyLimit, limit=limit, refuse=too_large)
    app.add_middleware(KeyAuth, gateway=gateway)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return gateway.fail(400, validation_message(exc))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        reps = await gateway.source()
        return {"status": "ok", "replicas_in_rotation": len(reps)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "owned_by": "undertow"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: GatewayRequest, request: Request) -> Response:
        return await gateway.complete(req, request.headers.get(turns.SESSION_HEADER), request.state.client)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: GatewayChatRequest, request: Request) -> Response:
        return await gateway.chat(req, request.headers.get(turns.SESSION_HEADER), request.state.client, request.headers)

    @app.post("/v1/signals")
    async def signals(request: Request) -> JSONResponse:
        try:
            raw = await request.json()
        except (ValueError, RecursionError):  # RecursionError: arrays or objects nested past the parser's depth
            return gateway.fail(400, "the body is not JSON; send one signal event as a JSON object")
        if not isinstance(raw, dict):
            return gateway.fail(400, "send one signal event as a JSON object")
        try:
            return gateway.signal(raw, request.state.client)
        except ValidationError as exc:
            return gateway.fail(422, f"invalid signal: {exc.errors()[:3]}", "InvalidSignal")

    @app.get("/gateway/metrics")
    async def metrics() -> dict[str, Any]:
        return gateway.metrics()

    return app


SCOPES = {
    "/v1/completions": "serve",
    "/v1/chat/completions": "serve",
    "/v1/signals": "serve",
    "/gateway/metrics": "metrics",
}
"""The scope each authenticated path needs (``/health`` and ``/v1/models`` are open)."""


class KeyAuth:
    """ASGI middleware: the caller's key checked (and its rate) before the body is read or validated;
    the client lands in ``request.state.client``."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        needed = SCOPES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if needed is None:
            await self.app(scope, receive, send)
            return
        authorization = next((bytes(v).decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        client = await self.gateway.authorize(authorization, needed)
        if isinstance(client, JSONResponse):
            await client(scope, receive, send)
            return
        scope.setdefault("state", {})["client"] = client
        await self.app(scope, receive, send)


def registry_source(db: Engine, pool: str, refresh_s: float) -> ReplicaSource:
    """Replicas in rotation from the registry, re-read at most every ``refresh_s`` seconds."""
    from serving.fleet import list_replicas

    cache: dict[str, Any] = {"at": 0.0, "reps": []}

    async def source() -> list[Replica]:
        if time.monotonic() - cache["at"] > refresh_s:
            reps = await asyncio.to_thread(list_replicas, db, pool)
            cache["reps"], cache["at"] = [r for r in reps if r.in_rotation], time.monotonic()
        return list(cache["reps"])

    return source


def health_loop(db: Engine, config: FleetConfig, pool: str) -> Callable[[], Awaitable[None]]:
    """A background job checking the pool's replicas every ``config.health_interval_s``."""
    from serving.fleet import check_fleet

    async def job() -> None:
        while True:
            try:
                await check_fleet(db, config, pool)
            except Exception as exc:  # a failed round (database busy) is retried at the next interval
                log.warning("gateway.health_check_failed", error=str(exc))
            await asyncio.sleep(config.health_interval_s)

    return job


def serve_gateway(
    gateway: Gateway, host: str, port: int, background: list[Callable[[], Awaitable[None]]] | None = None
) -> None:
    """Serve the gateway until interrupted."""
    import uvicorn

    uvicorn.run(create_gateway_app(gateway, background), host=host, port=port, log_level="warning", access_log=False)
