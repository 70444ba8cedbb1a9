"""One agent session end to end: the harness through the gateway and a CPU engine, its telemetry
through the embedded broker into a database by the ingest consumer, the stored turns joined into a
trajectory (:mod:`policy.trajectories`), and a training step on it with the masks checked."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from serving_helpers import consume, telemetry_gateway
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from policy.agent import SUMMARY_REQUEST, context_chars, gateway_client, run_session, task_message, verdict_report
from policy.checker import check
from policy.tasks import Task, all_tasks
from policy.windows import SUMMARY_TEXT

MODEL = "undertow-policy"
USER = "dev-traj"
SYSTEM = "Coding agent."
SHORT_TOOLS = [{"type": "function", "function": {"name": name}} for name in ("run_tests", "submit")]
TASK: Task = next(t for t in all_tasks() if t.tier == 1 and t.wrong)
BASE = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task_message(TASK)}]


@pytest.fixture(scope="module")
def tool_engine(sandbox: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A CPU engine serving a tiny policy taught, by a few supervised steps on one conversation, to
    answer with a well-formed ``run_tests`` call and a summary when asked (a random policy writes
    bytes that are not UTF-8, which the next turn's template re-renders as other tokens)."""
    from policy.model import build_model, save_checkpoint
    from policy.tokenizer import default_tokenizer
    from serving.launch import start_engines

    torch.manual_seed(0)
    tok = default_tokenizer()
    model = build_model("tiny", len(tok), 0)
    code = json.dumps({"code": TASK.concise})
    conversation = [
        *BASE,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "run_tests", "arguments": code}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": verdict_report(check(TASK, TASK.concise))},
        {"role": "user", "content": SUMMARY_REQUEST},
        {"role": "assistant", "content": SUMMARY_TEXT + " tested"},
    ]
    ids = torch.tensor([tok(tok.apply_chat_template(conversation, tools=SHORT_TOOLS, tokenize=False))["input_ids"]])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(200):
        logits = model(input_ids=ids).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert float(loss.detach()) < 0.05, (
        f"the tool-calling policy did not learn its conversation (loss {float(loss.detach()):.3f})"
    )
    ckpt = save_checkpoint(model, tok, tmp_path_factory.mktemp("tool-policy") / "ckpt")
    procs = start_engines(ckpt, 1, store=None, log_dir=tmp_path_factory.mktemp("logs"))
    yield procs[0]
    for p in procs:
        p.kill()


def _ingest(bootstrap: str, topic: str, url: str, expected: int) -> Any:
    from ingest.config import IngestConfig, KafkaConfig
    from ingest.consumer import IngestConsumer
    from ingest.db import make_engine, upgrade
    from ingest.tables import SessionRow

    upgrade(url)
    engine = make_engine(url)
    kafka = KafkaConfig(topic=topic, dlq_topic=f"{topic}.dlq", partitions=2, group_id=f"g-{uuid.uuid4().hex[:8]}")
    ingest = IngestConfig(batch_size=50, poll_timeout_ms=100, retry_initial_s=0.05, retry_max_s=0.5)
    deadline = time.monotonic() + 60
    while True:
        IngestConsumer(engine, bootstrap, kafka, ingest, mode="assign").run(once=True, max_seconds=30)
        with Session(engine) as db:
            rows = list(db.scalars(select(SessionRow).options(selectinload(SessionRow.segments))))
        if len(rows) >= expected or time.monotonic() > deadline:
            return engine, rows


def test_a_tool_calling_session_with_a_summary_becomes_one_masked_trajectory_and_trains(  # type: ignore[no-untyped-def]
    tool_engine, broker, tmp_path
) -> None:
    from transformers import AutoTokenizer

    from policy.model import load_checkpoint
    from policy.trainer import TrainConfig, make_optimizer, update_step
    from policy.trajectories import session_trajectories

    session = f"traj-{uuid.uuid4().hex[:8]}"
    with telemetry_gateway(tool_engine.url, broker.bootstrap, tmp_path / "spool", "traj") as (url, topic, _):
        with gateway_client(url, timeout_s=60) as client:
            result = run_session(
                client,
                TASK,
                model=MODEL,
                session_id=session,
                max_turns=2,
                context_budget_chars=context_chars(BASE) + 60,
                max_tokens=40,
                summary_max_tokens=8,
                temperature=0.0,
                system_prompt=SYSTEM,
                tools=SHORT_TOOLS,
                group="task-group",
                tool_choice="required",
                user=USER,
            )
            # the developer accepts what the session produced: one signal on the agent session as a whole
            signal = {"type": "edit.accepted", "session_id": session, "user_id": USER, "payload": {}}
            assert client.post("/v1/signals", json=signal).status_code == 202
        assert result.error is None, result.error
        assert result.tool_calls_ok >= 1 and result.summaries >= 1
        events = [e for e in consume(broker.bootstrap, topic, 10_000, timeout_s=5) if "turn" in e.get("payload", {})]
    assert len(events) == result.requests

    engine, rows = _ingest(broker.bootstrap, topic, f"sqlite:///{tmp_path / 'db.sqlite'}", result.requests)
    assert len(rows) == result.requests
    rollouts, stats = session_trajectories(rows, lambda row: 1.0, max_tokens=512)
    assert {r.session_id for r in rollouts} == {session} and {r.group_id for r in rollouts} == {"task-group"}
    assert stats.sessions == 1 and stats.turns == result.requests and stats.windows_dropped == 0

    # every generated token is trained, with the logprob its own turn was served with; nothing else is
    turns = sorted(events, key=lambda e: e["payload"]["turn"]["index"])
    generated = [t for e in turns for t in e["payload"]["segments"][0]["token_ids"]]
    served = [lp for e in turns for lp in e["payload"]["segments"][0]["logprobs"]]
    trained = [t for r in rollouts for t, m in zip(r.completion_ids, r.mask, strict=True) if m]
    trained_lps = [lp for r in rollouts for lp, m in zip(r.served_logprobs, r.mask, strict=True) if m]
    assert trained == generated and trained_lps == served
    context = [lp for r in rollouts for lp, m in zip(r.served_logprobs, r.mask, strict=True) if not m]
    assert context and all(math.isnan(lp) for lp in context)

    # the first window runs from the task through the tool call, its result and the summary; the
    # next starts from the summary
    tokenizer = AutoTokenizer.from_pretrained(tool_engine.checkpoint)
    summary_id = tokenizer.convert_tokens_to_ids(SUMMARY_TEXT)
    first, *rest = sorted(rollouts, key=lambda r: r.occurred_at)
    assert first.info["turns"] >= 2 and rest and all(summary_id in r.prompt_ids for r in rest)
    tool_result = turns[1]["payload"]["prompt"]["messages"][-2]
    assert tool_result["role"] == "tool" and '"tests"' in tool_result["content"]
    masked_text = tokenizer.decode([t for t, m in zip(first.completion_ids, first.mask, strict=True) if not m])
    assert tool_result["content"] in masked_text and SUMMARY_REQUEST in masked_text
    assert first.prompt_ids == turns[0]["payload"]["prompt"]["token_ids"]

    # turn-level credit: each trained token knows its turn, and turn 0 carries the verdict its
    # run_tests got, read back from the next turn's stored conversation
    from policy.feedback import verdict_score

    turn_of_token = [int(t) for r in rollouts for t, m in zip(r.token_turns, r.mask, strict=True) if m]
    segments = [(e["payload"]["turn"]["index"], e["payload"]["segments"][0]["token_ids"]) for e in turns]
    assert turn_of_token == [index for index, ids in segments for _ in ids]
    expected = verdict_score(tool_result["content"])
    assert expected is not None and all(r.turn_feedback == {0: expected} for r in rollouts)
    for r in rollouts:  # replay covers every turn of the window
        assert r.routed_experts is not None
        assert r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.completion_ids) - 1

    # one update on the trajectory: the trainer's logprobs on the trained tokens are the served ones
    model, _ = load_checkpoint(tool_engine.checkpoint)
    cfg = TrainConfig(lr=1e-3, steps=1)
    metrics = update_step(model, make_optimizer(model, cfg), rollouts, cfg)
    assert metrics["batch/trained_tokens"] == len(generated)
    assert metrics["gap/max_abs_logprob"] < 1e-4, metrics
    assert np.isfinite(metrics["loss/total"]) and metrics["optim/grad_norm"] > 0

    # the production update finds the session by its own id (no stored row has it) and trains it
    # with the reward its signal gave every turn
    _production_update_trains_the_session(engine, f"sqlite:///{tmp_path / 'db.sqlite'}", tool_engine, session, tmp_path)
    engine.dispose()


def _production_update_trains_the_session(engine, url: str, tool_engine, session: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from policy.config import PolicyConfig
    from policy.production import ProductionSession, TrainRequest, session_rewards
    from policy.versions import record_version
    from reward_models.config import RewardsConfig

    deadline = time.monotonic() + 30
    while not _signals(engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    rewards = session_rewards(engine, RewardsConfig())
    turn_rewards = {rewards[k] for k in rewards if k.startswith(f"{session}.t")}
    assert len(turn_rewards) == 1 and next(iter(turn_rewards)) > 0.5, rewards  # the accept reached every turn
    record_version(engine, version="v0000", parent=None, step=0, checkpoint_path=tool_engine.checkpoint, metrics={})
    request = TrainRequest(steps=1, groups_per_step=1)
    prod = ProductionSession(PolicyConfig(), RewardsConfig(), url, tmp_path / "home", request)
    assert prod.plan == [[(session, next(iter(turn_rewards)))]]
    metrics = prod.step()
    assert metrics["batch/rollouts"] >= 2  # the session's windows, trained together
    assert metrics["reward/mean"] == pytest.approx(next(iter(turn_rewards)))
    assert np.isfinite(metrics["loss/total"])


def _signals(engine) -> int:  # type: ignore[no-untyped-def]
    from sqlalchemy import func

    from ingest.tables import SignalRow

    with Session(engine) as db:
        return int(db.scalar(select(func.count()).select_from(SignalRow)) or 0)


def test_an_engine_that_dies_mid_session_leaves_the_session_whole(versions, broker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The gateway carries the session on with the other replica, and every turn is stored once."""
    from policy.agent import AgentSession
    from serving.launch import start_engines

    session_id = f"fault-{uuid.uuid4().hex[:8]}"
    procs = start_engines(versions.checkpoint, 2, store=None, log_dir=tmp_path)
    try:
        with telemetry_gateway([p.url for p in procs], broker.bootstrap, tmp_path / "spool", "fault") as (
            url,
            topic,
            gateway,
        ):
            session = AgentSession(TASK, session_id=session_id, max_turns=4, max_tokens=8, system_prompt=SYSTEM)
            holders = []
            with gateway_client(url, timeout_s=60) as client:
                while (ask := session.request()) is not None:
                    body = {"model": MODEL, "tools": SHORT_TOOLS, "seed": session.turn_index, **ask}
                    headers = {"x-session-id": session_id, "x-turn-index": str(session.turn_index)}
                    resp = client.post("/v1/chat/completions", json=body, headers=headers)
                    assert resp.status_code == 200, resp.text
                    session.observe(resp.json()["choices"][0]["message"])
                    holders.append(gateway.affinity[session_id])
                    if session.turn_index == 1:  # mid-session: the replica holding the session dies
                        procs[int(holders[-1][1:])].kill()
            events: list[dict[str, Any]] = []
            for _ in range(10):
                events = [
                    e
                    for e in consume(broker.bootstrap, topic, 10_000, timeout_s=3)
                    if (e.get("payload") or {}).get("turn", {}).get("session_id") == session_id
                ]
                if len(events) >= session.result.requests:
                    break
    finally:
        for p in procs:
            p.kill()
    assert session.result.error is None and session.result.turns == 4
    assert sorted(e["payload"]["turn"]["index"] for e in events) == [0, 1, 2, 3]  # each turn once
    # the session kept its replica while it lived (affinity), then moved to the survivor and stayed
    assert holders[0] == holders[1] and holders[2] == holders[3] and holders[2] != holders[1], holders
