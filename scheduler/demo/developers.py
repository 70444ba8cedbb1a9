"""Simulated developers: they use the assistant through the gateway and react to what it writes.

Arrivals follow the ServeGen production trace (one day of 10-minute windows, compressed into the
traffic phase, scaled to a mean wall-clock rate the CPU fleet can serve; the next day follows
until the developers are halted, so a version still being gated at the end gets its traffic). Each request is a
training task of the family (never a held-out one), sent as prompt token ids with ``candidates: K``
most of the time. The developers' preference is hidden from the system: they **keep** code that
passes the task's hidden tests and is concise (the task family's keep rule,
:func:`policy.checker.check`) and rewrite the rest. What they send back, all through the
gateway's ``POST /v1/signals`` (so through Kafka into the database):

- ``candidates.shown`` and ``candidate.selected`` for a candidate group: they pick the best
  candidate (kept over merely passing over failing; ties at random);
- ``edit.accepted`` when the chosen code passes the tests (they take it), else ``edit.rejected``;
- ``code.retained`` at three horizons (time-compressed): kept code stays, passing but verbose code
  is rewritten down to its concise size, failing code is deleted;
- ``model.switched`` now and then when nothing they were shown even passes.

A share of the arrivals (``agent_share``) hands the task to the **agent** instead
(:class:`policy.agent.AgentSession`, the harness's protocol: ``run_tests``/``submit`` tools, the
context budget and self-summaries, a turn limit), ``agent_group`` sessions in parallel on the task
(one ``x-session-group``, compared by GRPO), every turn a ``POST /v1/chat/completions`` with the
session id and turn index. What was submitted is judged like a completion and signalled on the
agent session as a whole (``edit.accepted``/``edit.rejected`` and ``code.retained``; a session that
never submitted is rejected and nothing of it retained).

With a ``population`` (``undertow demo --population``), the users are drawn from
:class:`scheduler.demo.population.Population` instead, and what they do is its decision: tastes,
skill and patience differ, most signals are never reported, choices and accept decisions are noisy,
thumbs are rare and biased, a few users are bad actors, and retention arrives at 1 hour, 1 day and 1
week of simulated time (compressed like the day). Each signal is sent when it arrives; those due
after the run are counted (``signals_late``), not sent. The true utility of every session for its
user goes to a local JSON-lines log (``utility_log``) for evaluation, never over the wire.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import structlog

if TYPE_CHECKING:
    from scheduler.demo.population import PopulationConfig

log = structlog.get_logger(__name__)

SECONDS_PER_DAY = 86400.0
WINDOW_S = 600.0


@dataclass
class DeveloperConfig:
    """How the simulated developers behave."""

    mean_rps: float = 0.5
    """Mean wall-clock request rate over the replayed day (the trace's shape, this mean)."""
    candidates: int = 4
    """K of a candidate group."""
    group_share: float = 0.85
    """Share of requests that ask for K candidates (the rest ask for one)."""
    max_tokens: int = 48
    """Completion length limit (the task family's bodies are short)."""
    temperature: float = 1.0
    """Sampling temperature the assistant is used at."""
    horizons_s: tuple[int, ...] = (60, 600, 3600)
    """Retention horizons in simulated seconds."""
    switch_prob: float = 0.3
    """Probability of switching models after a request where nothing passed."""
    max_inflight: int = 4
    """Requests in flight at once; arrivals beyond wait (a developer waits for the answer)."""
    users: int = 24
    """Distinct developers."""
    agent_share: float = 0.0
    """Share of arrivals given to the agent (multi-turn sessions with tools) instead of a completion."""
    agent_group: int = 2
    """Agent sessions run in parallel on one task (a GRPO group)."""
    agent: dict[str, Any] = field(default_factory=dict)
    """:class:`policy.agent.AgentSession` settings (``max_turns``, ``context_budget_chars``, ...; the
    defaults are :class:`policy.agent_eval.AgentEvalConfig`'s)."""
    population: PopulationConfig | None = None
    """Users drawn from this population (:mod:`scheduler.demo.population`: different tastes, partial,
    noisy and late signals, switches, churn, bad actors) instead of the deterministic developers."""
    drain_s: float = 5.0
    """Wall-clock seconds the signals still due are waited for once the developers are halted; later
    ones (a week's retention) would arrive after the run and are counted, not sent."""


@dataclass
class DeveloperStats:
    """What the developers did (for the progress line and the final report)."""

    requests: int = 0
    errors: int = 0
    signals: int = 0
    signal_errors: int = 0
    kept: int = 0
    passed: int = 0
    judged: int = 0
    by_version: Counter[str] = field(default_factory=Counter)
    kept_by_version: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    agent_sessions: int = 0
    agent_submitted: int = 0
    agent_kept: int = 0
    agent_turns: int = 0
    """Chat requests of the finished agent sessions (policy turns and summary turns)."""
    agent_summaries: int = 0
    """Agent sessions with at least one self-summary."""
    agent_errors: int = 0
    signals_late: int = 0
    """Signals of the population that would arrive after the run (not sent)."""
    utility_by_version: dict[str, float] = field(default_factory=dict)
    """Sum of the true utility of what the users took, by version (population only; never sent)."""
    judged_by_version: Counter[str] = field(default_factory=Counter)
    churned: int = 0


def arrival_schedule(
    rates: np.ndarray, span_s: float, mean_rps: float, rng: np.random.Generator, days: int = 1
) -> np.ndarray:
    """Arrival offsets in ``[0, days * span_s)``: a Poisson process whose rate follows one day of
    ``rates`` (10-minute windows) compressed into ``span_s`` per day and scaled to ``mean_rps`` on
    average; later days repeat the first (traffic goes on while the last update is gated)."""
    day = np.asarray(rates[: int(SECONDS_PER_DAY // WINDOW_S)], dtype=np.float64)
    shape = np.tile(day / day.mean(), days)
    per_window = span_s / len(day)
    out = []
    for i, s in enumerate(shape):
        n = rng.poisson(mean_rps * s * per_window)
        out.append(i * per_window + rng.uniform(0, per_window, n))
    return np.sort(np.concatenate(out)) if out else np.zeros(0)


def retained_lines(body: str, kept: bool, passed: bool, size_limit: int, size: int, fraction: float) -> tuple[int, int]:
    """``(lines_written, lines_retained)`` at a horizon ``fraction`` (0..1) of the longest one."""
    written = max(1, len([line for line in body.splitlines() if line.strip()]))
    if kept:
        share = 1.0
    elif passed:
        share = min(1.0, size_limit / max(size, 1)) * (1.0 - 0.5 * fraction)  # rewritten shorter over time
    else:
        share = 0.3 * (1.0 - fraction)  # deleted
    return written, round(written * share)


class Developers:
    """The developer population replaying the trace against one gateway."""

    def __init__(
        self,
        gateway_url: str,
        tokenizer: Any,
        rates: np.ndarray,
        span_s: float,
        speedup: float,
        config: DeveloperConfig,
        seed: int = 0,
        api_key: str | None = None,
        utility_log: Path | None = None,
    ) -> None:
        from policy.tasks import train_tasks
        from scheduler.demo.population import Population

        self.url = gateway_url.rstrip("/")
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer
        self.config = config
        self.speedup = speedup
        self.rng = random.Random(seed)
        self.tasks = [t for t in train_tasks() if not t.heldout]
        self.arrivals = arrival_schedule(rates, span_s, config.mean_rps, np.random.default_rng(seed), days=2)
        self.stats = DeveloperStats()
        self._halt = threading.Event()
        self._pending: set[asyncio.Task[Any]] = set()
        self._deliveries: set[asyncio.Task[Any]] = set()
        self.population = Population(config.population, seed=seed) if config.population is not None else None
        self.utility_log = utility_log
        self._users = {u.user_id: u for u in self.population.users} if self.population is not None else {}
        self._log_lock = threading.Lock()
        self._session_version: dict[str, str] = {}

    async def run(self) -> DeveloperStats:
        """Replay every arrival (or until :meth:`halt`), then wait for the signals in flight."""
        from policy.sft import prompt_ids

        sem = asyncio.Semaphore(self.config.max_inflight)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=180.0, limits=limits, headers=self.headers) as http:
            start = time.monotonic()
            for at in self.arrivals:
                while not self._halt.is_set() and (delay := at - (time.monotonic() - start)) > 0:
                    await asyncio.sleep(min(delay, 0.25))
                if self._halt.is_set():
                    break
                await sem.acquire()
                task = self.rng.choice(self.tasks)
                if self.population is not None:
                    user = self.population.draw(self.rng).user_id
                else:
                    user = f"dev-{self.rng.randrange(self.config.users):03d}"
                if self.rng.random() < self.config.agent_share:
                    job = asyncio.ensure_future(self._agent(http, task, user, sem))
                else:
                    k = self.config.candidates if self.rng.random() < self.config.group_share else 1
                    prompt = prompt_ids(self.tokenizer, task)
                    job = asyncio.ensure_future(self._request(http, task, prompt, user, k, sem))
                self._pending.add(job)
                job.add_done_callback(self._pending.discard)
            if self._pending:
                await asyncio.gather(*list(self._pending), return_exceptions=True)
            await self._drain()
        return self.stats

    async def _drain(self) -> None:
        """Wait ``drain_s`` for the signals still on their way; cancel and count the later ones."""
        if self._deliveries:
            _done, late = await asyncio.wait(list(self._deliveries), timeout=self.config.drain_s)
            for job in late:
                job.cancel()
            self.stats.signals_late += len(late)

    def halt(self) -> None:
        """Stop sending new requests (thread-safe; retention signals already scheduled still go out)."""
        self._halt.set()

    async def _signal(
        self, http: httpx.AsyncClient, kind: str, session_id: str, user: str, payload: dict[str, Any]
    ) -> None:
        body = {"type": kind, "session_id": session_id, "user_id": user, "payload": payload}
        try:
            resp = await http.post(self.url + "/v1/signals", json=body)
            ok = resp.status_code == 202
        except httpx.HTTPError:
            ok = False
        self.stats.signals += ok
        self.stats.signal_errors += not ok

    async def _request(
        self, http: httpx.AsyncClient, task: Any, prompt: list[int], user: str, k: int, sem: asyncio.Semaphore
    ) -> None:
        from policy.checker import check_many
        from policy.evaluate import decode_body

        cfg = self.config
        body = {
            "prompt": prompt,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "candidates": k,
            "user": user,
            "logprobs": 0,
            "return_token_ids": True,
        }
        try:
            started = time.monotonic()
            try:
                resp = await http.post(self.url + "/v1/completions", json=body)
            except httpx.HTTPError:
                self.stats.errors += 1
                return
            if resp.status_code != 200:
                self.stats.errors += 1
                return
            self.stats.latencies.append(time.monotonic() - started)
        finally:
            sem.release()
        data = resp.json()
        version = str(data.get("policy_version"))
        choices = data["choices"]
        bodies = [decode_body(self.tokenizer, list(c.get("token_ids") or [])) for c in choices]
        results = await asyncio.to_thread(check_many, [(task, b) for b in bodies])
        self.stats.requests += 1
        self.stats.by_version[version] += 1
        if self.population is not None:
            self.stats.judged += 1
            self.stats.kept += any(r.kept for r in results)
            self.stats.passed += any(r.passed for r in results)
            self.stats.kept_by_version[version] += any(r.kept for r in results)
            outcomes = [self._outcome(task, b, r) for b, r in zip(bodies, results, strict=True)]
            ids = [c["session_id"] for c in choices]
            self._react(http, user, outcomes, ids, [version] * len(ids), data.get("group_id"))
            return
        order = sorted(range(len(choices)), key=lambda i: (-results[i].kept, -results[i].passed, self.rng.random()))
        best = order[0]
        chosen = choices[best]["session_id"]
        res = results[best]
        self.stats.judged += 1
        self.stats.kept += res.kept
        self.stats.passed += res.passed
        self.stats.kept_by_version[version] += res.kept
        if data.get("group_id"):
            ids = [c["session_id"] for c in choices]
            await self._signal(
                http, "candidates.shown", ids[0], user, {"group_id": data["group_id"], "session_ids": ids}
            )
            await self._signal(
                http, "candidate.selected", chosen, user, {"group_id": data["group_id"], "chosen_session_id": chosen}
            )
        await self._signal(http, "edit.accepted" if res.passed else "edit.rejected", chosen, user, {})
        if not any(r.passed for r in results) and self.rng.random() < cfg.switch_prob:
            await self._signal(http, "model.switched", chosen, user, {"from_model": "undertow", "to_model": "other"})
        await self._retention(http, task, user, [(chosen, bodies[best], res.kept, res.passed, res.size)])

    @staticmethod
    def _outcome(task: Any, body: str | None, result: Any) -> Any:
        """What the population judges: the checker's verdict on what was written (None: nothing submitted)."""
        from scheduler.demo.population import Outcome

        if body is None or result is None:
            return Outcome(passed=False, kept=False, lines=0, submitted=False)
        lines = max(1, len([line for line in body.splitlines() if line.strip()]))
        return Outcome(
            passed=bool(result.passed),
            kept=bool(result.kept),
            lines=lines,
            size=int(result.size),
            size_limit=int(task.size_limit),
        )

    def _react(
        self,
        http: httpx.AsyncClient,
        user_id: str,
        outcomes: list[Any],
        ids: list[str],
        versions: list[str],
        group_id: str | None,
    ) -> None:
        """The population's reaction to one request's sessions: each signal is sent when it arrives
        (its simulated delay compressed like the day), the true utility is logged apart, never sent."""
        assert self.population is not None
        user = self._users[user_id]
        grouped = group_id is not None and len(outcomes) >= 2
        reaction = self.population.react(user, outcomes, grouped=grouped, rng=self.rng)
        taken = reaction.chosen  # what the user took into their code (none: they wrote it themselves)
        value = reaction.utility[taken] if taken is not None else 0.0
        version = versions[taken if taken is not None else 0]
        self.stats.utility_by_version[version] = self.stats.utility_by_version.get(version, 0.0) + value
        self.stats.judged_by_version[version] += 1
        self.stats.churned += reaction.churned
        if self.utility_log is not None:
            rows = [
                {
                    "session_id": sid,
                    "user_id": user_id,
                    "version": versions[i],
                    "utility": round(reaction.utility[i], 6),
                    "taken": i == taken,
                }
                for i, sid in enumerate(ids)
            ]
            with self._log_lock, self.utility_log.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        for sig in reaction.signals:
            sid = ids[sig.index] if sig.index is not None else ids[0]
            payload = dict(sig.payload)
            if sig.type == "candidates.shown":
                payload.update(group_id=group_id, session_ids=ids)
            elif sig.type == "candidate.selected":
                payload.update(group_id=group_id, chosen_session_id=sid)
            job = asyncio.ensure_future(self._later(http, sig.delay_s / self.speedup, sig.type, sid, user_id, payload))
            self._deliveries.add(job)
            job.add_done_callback(self._deliveries.discard)

    async def _later(
        self, http: httpx.AsyncClient, delay: float, kind: str, session_id: str, user: str, payload: dict[str, Any]
    ) -> None:
        await asyncio.sleep(delay)
        await self._signal(http, kind, session_id, user, payload)

    async def _retention(
        self, http: httpx.AsyncClient, task: Any, user: str, judged: list[tuple[str, str | None, bool, bool, int]]
    ) -> None:
        """``code.retained`` at each horizon (time-compressed) for each ``(session, body, kept, passed,
        size)``; a body of None (nothing was submitted) has nothing retained."""
        longest = max(self.config.horizons_s)
        waited = 0.0
        for horizon in self.config.horizons_s:
            wait = horizon / self.speedup - waited
            if wait > 0:
                await asyncio.sleep(wait)
                waited += wait
            for session_id, body, kept, passed, size in judged:
                written, retained = retained_lines(body or "", kept, passed, task.size_limit, size, horizon / longest)
                payload = {
                    "horizon_s": horizon,
                    "lines_written": written,
                    "lines_retained": retained if body is not None else 0,
                }
                await self._signal(http, "code.retained", session_id, user, payload)

    async def _agent_session(self, http: httpx.AsyncClient, session: Any, user: str) -> None:
        from policy.agent import GROUP_HEADER, SESSION_HEADER, TURN_HEADER
        from policy.agent_eval import AGENT_TOOLS

        body: dict[str, Any] = {"model": "undertow", "tools": AGENT_TOOLS, "user": user}
        body["temperature"] = self.config.temperature
        while (ask := session.request()) is not None:
            headers = {SESSION_HEADER: session.result.session_id, TURN_HEADER: str(session.turn_index)}
            if session.result.group:
                headers[GROUP_HEADER] = session.result.group
            try:
                resp = await http.post(self.url + "/v1/chat/completions", json={**body, **ask}, headers=headers)
            except httpx.HTTPError as exc:
                session.fail(str(exc))
                return
            if resp.status_code != 200:
                session.fail(f"{resp.status_code}: {resp.text[:200]}")
                return
            data = resp.json()
            version = str(data.get("policy_version", "?"))
            self.stats.by_version[version] += 1
            self._session_version[session.result.session_id] = version
            await asyncio.to_thread(session.observe, data["choices"][0]["message"])

    async def _agent(self, http: httpx.AsyncClient, task: Any, user: str, sem: asyncio.Semaphore) -> None:
        """``agent_group`` agent sessions on ``task``, then the developer's signals on each."""
        import uuid

        from policy.agent import AgentSession
        from policy.agent_eval import AGENT_SYSTEM_PROMPT, AgentEvalConfig

        cfg = self.config
        defaults = AgentEvalConfig()
        settings = {
            "max_turns": defaults.max_turns,
            "context_budget_chars": defaults.context_budget_chars,
            "max_tokens": defaults.max_tokens,
            "summary_max_tokens": defaults.summary_max_tokens,
            **cfg.agent,
        }
        group = f"grp-{uuid.uuid4().hex[:12]}" if cfg.agent_group > 1 else None
        sessions = [
            AgentSession(task, system_prompt=AGENT_SYSTEM_PROMPT, group=group, **settings)
            for _ in range(cfg.agent_group)
        ]
        try:
            await asyncio.gather(*(self._agent_session(http, s, user) for s in sessions))
        finally:
            sem.release()
        judged: list[tuple[str, str | None, bool, bool, int]] = []
        outcomes: list[Any] = []
        ids: list[str] = []
        for session in sessions:
            result = session.result
            if result.ended == "error":
                self.stats.agent_errors += 1
                continue
            verdict = result.verdict
            kept, passed = bool(verdict and verdict.kept), bool(verdict and verdict.passed)
            self.stats.agent_sessions += 1
            self.stats.agent_submitted += result.ended == "submitted"
            self.stats.agent_kept += kept
            self.stats.agent_turns += result.requests
            self.stats.agent_summaries += result.summaries > 0
            if self.population is not None:
                submitted = result.ended == "submitted" and result.submitted_code is not None
                outcomes.append(self._outcome(task, result.submitted_code if submitted else None, verdict))
                ids.append(result.session_id)
                continue
            await self._signal(http, "edit.accepted" if passed else "edit.rejected", result.session_id, user, {})
            judged.append((result.session_id, result.submitted_code, kept, passed, verdict.size if verdict else 0))
        if self.population is not None:
            if ids:  # parallel agent sessions are judged each on its own
                versions = [self._session_version.pop(sid, "?") for sid in ids]
                self._react(http, user, outcomes, ids, versions, None)
            return
        await self._retention(http, task, user, judged)
