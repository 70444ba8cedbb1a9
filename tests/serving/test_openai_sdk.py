"""The official ``openai`` SDK against the gateway in front of a CPU engine: chat and completions,
sync and async, whole and streamed, with tools; multi-turn agent sessions in telemetry, exactly
as sampled; an abandoned stream stops the generation; bad input in OpenAI's error shape, counted.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from serving_helpers import consume, telemetry_gateway

from serving.gateway import Gateway

MODEL = "undertow-policy"
TOOLS = [
    {"type": "function", "function": {"name": "run_tests", "parameters": {"properties": {"code": {}}}}},
    {"type": "function", "function": {"name": "submit"}},
]


class Stack:
    """A gateway (with telemetry to a fresh topic) in front of one engine."""

    def __init__(self, url: str, engine_url: str, bootstrap: str, topic: str, gateway: Gateway) -> None:
        self.url, self.engine_url, self.bootstrap, self.topic, self.gateway = url, engine_url, bootstrap, topic, gateway

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def events(self, n: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        return consume(self.bootstrap, self.topic, n, timeout_s)


@pytest.fixture(scope="module")
def stack(one_engine, broker, tmp_path_factory) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    with telemetry_gateway(one_engine.url, broker.bootstrap, tmp_path_factory.mktemp("spool"), "chat") as (
        url,
        topic,
        gateway,
    ):
        yield Stack(url, one_engine.url, broker.bootstrap, topic, gateway)


def _engine_counter(url: str, name: str, reason: str | None = None) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and (reason is None or f'finished_reason="{reason}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _answer_tokens(stack: Stack) -> tuple[int, int]:
    """How many answers the gateway has counted the length of, and their total tokens (every version)."""
    versions = httpx.get(stack.url + "/gateway/metrics", timeout=10).json()["versions"].values()
    n = sum(v["answer_tokens_n"] for v in versions)
    total = sum(round((v["answer_tokens_mean"] or 0.0) * v["answer_tokens_n"]) for v in versions)
    return n, total


def test_chat_sync_and_async_whole_and_streamed(stack: Stack) -> None:
    client = stack.client()
    counted = _answer_tokens(stack)
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=7)  # type: ignore[arg-type]
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens > 5

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content, "a streamed answer is the whole answer cut into pieces"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    async def run_async() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        one = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=7)  # type: ignore[arg-type]
        parts = []
        async for chunk in await aclient.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            seed=7,
            stream=True,
        ):
            parts.extend(c.delta.content or "" for c in chunk.choices)
        await aclient.close()
        return one.choices[0].message.content or "", "".join(parts)

    one, streamed = asyncio.run(run_async())
    assert one == streamed == choice.message.content
    # the rollout gate's length check sees every answer, streamed ones included, at the length served
    n, total = _answer_tokens(stack)
    assert (n - counted[0], total - counted[1]) == (4, 4 * whole.usage.completion_tokens)


def test_completions_streamed_with_logprobs(stack: Stack) -> None:
    client = stack.client()
    whole = client.completions.create(model=MODEL, prompt="def add", max_tokens=10, seed=3, logprobs=2)
    stream = client.completions.create(model=MODEL, prompt="def add", max_tokens=10, seed=3, logprobs=2, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed_tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    assert whole.choices[0].logprobs is not None and streamed_tokens == whole.choices[0].logprobs.tokens
    tops = whole.choices[0].logprobs.top_logprobs or []
    assert tops and all(len(top) <= 2 for top in tops)
    # the sampled token's logprob can be no larger than the best alternative's
    for lp, top in zip(whole.choices[0].logprobs.token_logprobs or [], tops, strict=True):
        assert lp <= max(top.values()) + 1e-6


def test_tools_and_a_multi_turn_session_in_telemetry(stack: Stack, versions) -> None:  # type: ignore[no-untyped-def]
    client = stack.client()
    counted = _answer_tokens(stack)
    session = f"agent-{uuid.uuid4().hex[:10]}"
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Write add(a, b) and test it."},
    ]
    first = client.chat.completions.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "run_tests"}},
        max_tokens=16,
        seed=1,
        extra_headers={"x-session-id": session},
    )
    calls = first.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "run_tests" and calls[0].id
    history.append(first.choices[0].message.model_dump(exclude_none=True))
    history.append({"role": "tool", "tool_call_id": calls[0].id, "content": "2 passed, 1 failed: add(2, 2) != 4"})
    second = client.chat.completions.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=16,
        seed=2,
        stream=True,
        extra_headers={"x-session-id": session},
    )
    streamed = [c for c in second if c.choices]
    names = [t.function.name for c in streamed for t in c.choices[0].delta.tool_calls or [] if t.function]
    assert len(names) == 1 and names[0] in ("run_tests", "submit")
    history.append({"role": "assistant", "content": "done"})
    history.append({"role": "user", "content": "Thanks."})
    third = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=6,
        seed=3,  # type: ignore[arg-type]
        extra_headers={"x-session-id": session},
    )
    assert not third.choices[0].message.tool_calls
    n, total = _answer_tokens(stack)  # tool-call answers (no text) count at their length too
    assert first.usage is not None and third.usage is not None
    assert n - counted[0] == 3
    assert total - counted[1] > first.usage.completion_tokens + third.usage.completion_tokens

    for target in (session, f"{session}.t1"):
        signal = httpx.post(
            stack.url + "/v1/signals",
            json={"type": "edit.accepted", "session_id": target, "payload": {"lines": 2}},
            timeout=10,
        )
        assert signal.status_code == 202, signal.text

    turns = _turns(stack, session, 3)
    assert [e["session_id"] for e in turns] == [f"{session}.t0", f"{session}.t1", f"{session}.t2"]
    assert [e["payload"]["turn"] for e in turns] == [{"session_id": session, "index": i} for i in range(3)]
    tool_turn = turns[1]["payload"]["prompt"]
    assert tool_turn["messages"][-1]["role"] == "tool" and "add(2, 2) != 4" in tool_turn["messages"][-1]["content"]
    assert turns[0]["payload"]["segments"][0]["tool_calls"][0]["function"]["name"] == "run_tests"
    _served_exactly(turns, versions.checkpoint)


def test_a_client_numbers_its_turns_and_names_its_session_group(stack: Stack) -> None:
    """After a compaction the assistant messages are counted from zero again: the client's own index
    keeps the turns apart, and the session group it names is stored with every turn."""
    session = f"numbered-{uuid.uuid4().hex[:8]}"
    client = stack.client()
    for index in (0, 5):  # turn 5 comes after a compaction: no assistant message in the conversation
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "def f(x):"}],
            max_tokens=2,
            extra_headers={"x-session-id": session, "x-turn-index": str(index), "x-session-group": "task-7"},
        )
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def f(x):"}],
        max_tokens=2,
        metadata={"session_id": session, "turn_index": "9", "session_group": "task-7"},
    )
    turns = _turns(stack, session, 3)
    assert [e["session_id"] for e in turns] == [f"{session}.t0", f"{session}.t5", f"{session}.t9"]
    assert [e["payload"]["turn"] for e in turns] == [
        {"session_id": session, "index": i, "group": "task-7"} for i in (0, 5, 9)
    ]


def _turns(stack: Stack, session: str, n: int) -> list[dict[str, Any]]:
    from ingest.schemas import validate_event

    deadline = time.monotonic() + 30
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline and len(found) < n:
        events = stack.events(10_000, timeout_s=3)
        found = [e for e in events if (e.get("payload") or {}).get("turn", {}).get("session_id") == session]
    for e in found:
        validate_event(e)  # the wire contract accepts what the gateway emits
    return sorted(found, key=lambda e: e["payload"]["turn"]["index"])


def _served_exactly(turns: list[dict[str, Any]], checkpoint: Any) -> None:
    """The prompt ids are the checkpoint's chat template rendered (tool outputs included), and the
    logprobs and routed experts are what the trainer's forward pass recomputes, bit for bit."""
    import base64
    import io

    from policy.forward import score_tokens
    from policy.model import load_checkpoint

    model, tokenizer = load_checkpoint(checkpoint)
    for event in turns:
        payload = event["payload"]
        prompt = payload["prompt"]["token_ids"]
        messages = payload["prompt"]["messages"]
        rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
        rendered_ids = (
            list(rendered["input_ids"]) if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
        )
        assert prompt[: len(rendered_ids)] == rendered_ids, "prompt ids are the chat template's (plus a forced opening)"
        segment = payload["segments"][0]
        ids = segment["token_ids"]
        assert ids and len(segment["logprobs"]) == len(ids)
        scored = score_tokens(model, prompt + ids, prompt_len=len(prompt))
        assert np.array_equal(np.asarray(segment["logprobs"], dtype=np.float32), scored.logprobs)
        experts = np.load(io.BytesIO(base64.b64decode(payload["routed_experts"])), allow_pickle=False)
        assert np.array_equal(experts, scored.routed_experts)
    second = tokenizer.decode(turns[1]["payload"]["prompt"]["token_ids"])
    assert "<tool_response>\n2 passed, 1 failed: add(2, 2) != 4\n</tool_response>" in second


def test_finished_streams_reuse_one_connection_to_the_engine(stack: Stack) -> None:
    import psutil

    port = int(stack.engine_url.rsplit(":", 1)[1])

    def local_ports() -> set[int]:
        return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port}

    client = stack.client()
    seen: set[int] = set()
    for seed in range(3):
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=seed, stream=True
        )
        assert [c for c in chunks if c.choices]
        seen |= local_ports()
    assert len(seen) == 1, f"each finished stream went back to the pool, got connections from ports {seen}"


def _seed_that_runs_to_the_limit(stack: Stack, body: dict[str, Any], tries: int = 200) -> int:
    """A seed whose answer to ``body`` runs to ``max_tokens`` (the tiny model often samples its end
    of turn within a few tokens, and a stream that ended by itself was not abandoned)."""
    for seed in range(tries):
        answer = httpx.post(
            stack.url + "/v1/chat/completions",
            json={**body, "seed": seed, "stream": False},
            headers={"x-session-id": f"probe-{uuid.uuid4().hex[:8]}"},
            timeout=60,
        ).json()
        if answer["choices"][0]["finish_reason"] == "length":
            return seed
    raise AssertionError(f"none of {tries} seeds ran to max_tokens={body['max_tokens']}")


def test_an_abandoned_stream_stops_generation_and_is_recorded(stack: Stack) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "def loop():"}],
        "max_tokens": 400,
        "stop": ["\x00never"],
    }
    # Seeded sampling is deterministic, so with this seed the engine ends early only if the client leaves.
    body.update(seed=_seed_that_runs_to_the_limit(stack, body), stream=True)
    aborted = _engine_counter(stack.engine_url, "vllm:request_success_total", "abort")
    tokens_before = _engine_counter(stack.engine_url, "vllm:generation_tokens_total")
    session = f"gone-{uuid.uuid4().hex[:8]}"
    received = 0
    with httpx.stream(
        "POST", stack.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received >= 4:
                break
    deadline = time.monotonic() + 30
    while (
        time.monotonic() < deadline
        and _engine_counter(stack.engine_url, "vllm:request_success_total", "abort") == aborted
    ):
        time.sleep(0.2)
    assert _engine_counter(stack.engine_url, "vllm:request_success_total", "abort") == aborted + 1
    generated = _engine_counter(stack.engine_url, "vllm:generation_tokens_total") - tokens_before
    assert generated < 400, "the engine stopped generating when the client left"
    [event] = _turns(stack, session, 1)
    assert event["payload"]["finish_reason"] == "abort"
    assert 1 <= len(event["payload"]["segments"][0]["token_ids"]) < 400
    metrics = httpx.get(stack.url + "/gateway/metrics", timeout=10).json()
    assert metrics["errors"].get("ClientAbandonedStream", 0) >= 1


def test_a_streamed_candidate_group_is_one_turn_with_k_sessions(stack: Stack) -> None:
    session = f"group-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "def f():"}], "n": 2, "max_tokens": 5}
    with httpx.stream(
        "POST",
        stack.url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers={"x-session-id": session},
        timeout=60,
    ) as resp:
        assert resp.status_code == 200 and resp.headers["x-undertow-group-id"].startswith("grp-")
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    firsts = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if "session_id" in choice:
                firsts[choice["index"]] = choice["session_id"]
    assert firsts == {0: f"{session}.t0-0", 1: f"{session}.t0-1"}
    events = _turns(stack, session, 2)
    assert sorted(e["session_id"] for e in events) == [f"{session}.t0-0", f"{session}.t0-1"]
    assert {e["payload"]["group_id"] for e in events} == {resp.headers["x-undertow-group-id"]}
    assert sorted(e["payload"]["candidate_index"] for e in events) == [0, 1]
    assert all(e["payload"]["finish_reason"] in ("stop", "length") for e in events)


@pytest.mark.parametrize(
    ("messages", "extra", "needle"),
    [
        ([{"role": "wizard", "content": "hi"}], {}, "unknown role"),
        ([{"role": "tool", "content": "3"}], {}, "tool_call_id"),
        (
            [{"role": "user", "content": "x"}],
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}},
            "unknown tool",
        ),
        ([{"role": "user", "content": "x" * 3000}], {"max_tokens": 300}, "maximum context length"),
        ([], {}, "messages"),
        ([{"role": "user", "content": "x"}], {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ([{"role": "user", "content": "x"}], {"tools": TOOLS + TOOLS[:1]}, "same name"),
        ([{"role": "assistant", "content": None}], {}, "content or tool_calls"),
        ([{"role": "user", "content": "x"}], {"n": 99}, "limit"),
        ([{"role": "user", "content": "x"}], {"extra_headers": {"x-session-id": "s" * 101}}, "session id"),
        (
            [{"role": "user", "content": "x"}],
            {"extra_headers": {"x-session-id": "s", "x-turn-index": "-1"}},
            "turn index",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"extra_headers": {"x-session-id": "s", "x-turn-index": "1e3"}},
            "turn index",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"extra_headers": {"x-session-id": "s", "x-turn-index": "9" * 40}},
            "turn index",
        ),
        ([{"role": "user", "content": "x"}], {"metadata": {"session_id": "s", "turn_index": "²"}}, "turn index"),
        ([{"role": "user", "content": "x"}], {"extra_body": {"metadata": {"turn_index": True}}}, "turn index"),
        ([{"role": "user", "content": "x"}], {"extra_headers": {"x-session-group": "g" * 101}}, "session group"),
        ([{"role": "user", "content": "x"}], {"extra_body": {"metadata": {"session_group": 7}}}, "session group"),
    ],
)
def test_bad_chat_input_in_openai_error_shape_and_counted(stack: Stack, messages, extra, needle) -> None:  # type: ignore[no-untyped-def]
    before = sum(httpx.get(stack.url + "/gateway/metrics", timeout=10).json()["errors"].values())
    with pytest.raises(openai.BadRequestError) as err:
        stack.client().chat.completions.create(model=MODEL, messages=messages, **extra)
    assert err.value.status_code == 400
    body = err.value.body
    assert re.search(needle, str(body)), body
    after = sum(httpx.get(stack.url + "/gateway/metrics", timeout=10).json()["errors"].values())
    assert after == before + 1
