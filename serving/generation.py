"""One request's generation on the CPU engine, whole or streamed, shaped as vLLM's OpenAI server
shapes it, for ``/v1/completions`` and ``/v1/chat/completions``.

A :class:`Job` is what both endpoints reduce to: prompt token ids, sampling parameters, and how
to read the output back (plain text, or an assistant message with tool calls). :func:`run` answers
it in one response; :func:`stream` answers it as server-sent events. While streaming, sampling
runs on a worker thread and hands each step's tokens to the event loop; text is held back while
it could still grow into a stop string or a tool-call tag, so a streamed answer is the
non-streamed one cut into pieces. When the client goes away the stream's generator is closed,
sampling stops at its next step, and the in-flight count is released only once it has.

Extensions (vLLM's ``return_token_ids``, and Undertow's): choices carry ``token_ids`` and
``routed_experts``; the last chunk of each streamed choice carries ``token_logprobs``, the
re-scored logprobs of every token it served (what the trainer reproduces bit for bit).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policy.chat_template import TOOL_CALL_START
from policy.forward import SampledToken
from serving.chat import Reply, forced_reply, held_suffix, parse_tool_calls
from serving.protocol import SamplingParams
from serving.runner import ModelRunner, Sample


def encode_experts(array: np.ndarray) -> str:
    """Base64 of a ``.npy`` file, as vLLM sends ``routed_experts``."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass
class Job:
    """What to generate and how to answer."""

    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    model: str
    version: str
    top_logprobs: int | None = None
    """None: no logprobs; k >= 0: logprobs with the k most likely tokens."""
    return_token_ids: bool = False
    routed: bool = False
    include_usage: bool = False
    stream: bool = False
    tool_mode: str = "none"
    """``none``, ``auto`` (parse calls from the text), ``named`` or ``required`` (call opened by the engine)."""
    prefix: str = ""
    """Text the engine wrote for the model (a forced tool-call opening), already in ``prompt_ids``."""
    tool_name: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def reply(self, text: str) -> Reply:
        """The assistant message a sample's text makes."""
        if self.tool_mode in ("named", "required") and self.tool_name:
            return forced_reply(self.prefix, text, self.tool_name)
        if self.tool_mode == "auto":
            return parse_tool_calls(text)
        return Reply(text, [])

    def finish_reason(self, sample_reason: str, reply: Reply) -> str:
        if reply.tool_calls and sample_reason == "stop" and self.tool_mode != "named":
            return "tool_calls"
        return sample_reason

    def markers(self) -> list[str]:
        """Strings the stream holds text back for."""
        return self.params.stop + ([TOOL_CALL_START] if self.tool_mode == "auto" else [])


def _token(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def _chat_logprob(tokenizer: Any, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    text = _token(tokenizer, token_id)
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode()),
        "top_logprobs": [
            {"token": (t := _token(tokenizer, i)), "logprob": lp, "bytes": list(t.encode())} for i, lp in top
        ],
    }


def _legacy_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]] | None
) -> dict[str, Any]:
    tokens = [_token(tokenizer, t) for t in token_ids]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    top = [{_token(tokenizer, i): lp for i, lp in row} for row in tops] if tops is not None else None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [call.model_dump() for call in reply.tool_calls]
    return message


def run(job: Job, runner: ModelRunner) -> dict[str, Any]:
    """Generate and answer in one response body (runs on a worker thread)."""
    samples = runner.generate(job.params, job.prompt_ids, routed=job.routed)
    tokenizer = runner.tokenizer
    choices = []
    for index, sample in enumerate(samples):
        tops = None
        if job.top_logprobs:
            tops = runner.top_logprobs(job.prompt_ids, sample.token_ids, job.top_logprobs)
        choice: dict[str, Any] = {"index": index}
        if job.chat:
            reply = job.reply(sample.text)
            choice["message"] = _message(reply)
            choice["finish_reason"] = job.finish_reason(sample.finish_reason, reply)
            if job.top_logprobs is not None:
                rows = tops or [[] for _ in sample.token_ids]
                choice["logprobs"] = {
                    "content": [
                        _chat_logprob(tokenizer, t, lp, top)
                        for t, lp, top in zip(sample.token_ids, sample.logprobs, rows, strict=True)
                    ]
                }
            else:
                choice["logprobs"] = None
        else:
            choice["text"] = sample.text
            choice["finish_reason"] = sample.finish_reason
            choice["logprobs"] = (
                _legacy_logprobs(tokenizer, sample.token_ids, sample.logprobs, tops)
                if job.top_logprobs is not None
                else None
            )
            if job.return_token_ids:
                choice["prompt_token_ids"] = job.prompt_ids
        choice["stop_reason"] = sample.stop_reason
        if job.return_token_ids:
            choice["token_ids"] = sample.token_ids
        if sample.routed_experts is not None:
            choice["routed_experts"] = encode_experts(sample.routed_experts)
        choices.append(choice)
    completion = sum(len(s.token_ids) for s in samples)
    body: dict[str, Any] = {
        "id": job.response_id,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": _usage(len(job.prompt_ids), completion),
        "system_fingerprint": job.version,
    }
    if job.chat and job.return_token_ids:
        body["prompt_token_ids"] = job.prompt_ids
    return body


class _TextFilter:
    """One choice's streamed text: decoded incrementally, cut at a stop string, held back while a
    marker could still be forming, silent once a tool call has begun."""

    def __init__(self, tokenizer: Any, job: Job) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in job.params.stop if s]
        self.markers = [m for m in job.markers() if m]
        self.silent = job.tool_mode in ("named", "required")
        self.auto_tools = job.tool_mode == "auto"
        self.ids: list[int] = []
        self.sent = 0
        self.done = False
        self.in_tool = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        end = len(text)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                end, self.done = min(end, at), True
        if not self.done:
            end -= held_suffix(text, self.markers)
        if self.auto_tools:
            at = text.find(TOOL_CALL_START)
            if at >= 0:
                self.in_tool, end = True, min(end, at)
        if self.silent or end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta


class _Bridge:
    """Tokens from the sampling thread to the event loop; a flag the other way stops sampling."""

    def __init__(self, job: Job, tokenizer: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.filters = [_TextFilter(tokenizer, job) for _ in range(job.params.n)]

    def sink(self, tokens: list[SampledToken]) -> bool:
        if self.cancelled.is_set():
            return False
        out = []
        for token in tokens:
            f = self.filters[token.row]
            if f.done:
                continue
            out.append((token, f.push(token.token_id)))
        if out:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        return not all(f.done for f in self.filters)

    def finish(self, result: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("end", result))


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


Outcome = Callable[[list[str], int], Awaitable[None]]
"""Called once sampling has ended: each sample's finish reason and the tokens generated."""


async def stream(job: Job, runner: ModelRunner, release: Outcome) -> AsyncIterator[bytes]:
    """Server-sent events for ``job``; ``release`` runs once sampling has ended, however the stream
    ends (a client that went away: every sample finishes with ``abort``)."""
    tokenizer = runner.tokenizer
    bridge = _Bridge(job, tokenizer)

    def work() -> None:
        try:
            samples = runner.generate(
                job.params,
                job.prompt_ids,
                routed=job.routed,
                on_tokens=bridge.sink,
                top_k_stream=job.top_logprobs or 0,
            )
            bridge.finish(samples)
        except BaseException as exc:  # reported to the client as an error event
            bridge.finish(exc)

    task = asyncio.get_running_loop().run_in_executor(None, work)
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    head = {
        "id": job.response_id,
        "object": kind,
        "created": job.created,
        "model": job.model,
        "system_fingerprint": job.version,
    }
    result: Any = None
    try:
        if job.chat:
            for index in range(job.params.n):
                first: dict[str, Any] = {**head, "choices": [_chat_choice(index, {"role": "assistant", "content": ""})]}
                if job.return_token_ids and index == 0:
                    first["prompt_token_ids"] = job.prompt_ids
                yield _sse(first)
        while True:
            item = await bridge.queue.get()
            if isinstance(item, tuple) and item[0] == "end":
                result = item[1]
                break
            for token, delta in item:
                yield _sse({**head, "choices": [_step_choice(job, tokenizer, token, delta)]})
        if isinstance(result, BaseException):
            yield _sse(
                {"error": {"message": f"generation failed: {result}", "type": "InternalServerError", "code": 500}}
            )
            yield DONE
            return
        for index, sample in enumerate(result):
            yield _sse({**head, "choices": [_last_choice(job, index, sample, bridge.filters[index])]})
        if job.include_usage:
            usage = _usage(len(job.prompt_ids), sum(len(s.token_ids) for s in result))
            yield _sse({**head, "choices": [], "usage": usage})
        yield DONE
    finally:
        bridge.cancelled.set()
        try:
            await asyncio.shield(task)
        finally:
            if isinstance(result, list):
                await release([s.finish_reason for s in result], sum(len(s.token_ids) for s in result))
            else:
                await release(["abort"] * job.params.n, sum(len(f.ids) for f in bridge.filters))


def _chat_choice(index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **extra}


def _step_choice(job: Job, tokenizer: Any, token: SampledToken, delta: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"token_ids": [token.token_id]} if job.return_token_ids else {}
    if job.chat:
        choice = _chat_choice(token.row, {"content": delta} if delta else {}, **extra)
        if job.top_logprobs is not None:
            choice["logprobs"] = {"content": [_chat_logprob(tokenizer, token.token_id, token.logprob, token.top)]}
        return choice
    logprobs = None
    if job.top_logprobs is not None:
        tops = [token.top] if job.top_logprobs else None
        logprobs = _legacy_logprobs(tokenizer, [token.token_id], [token.logprob], tops)
    return {"index": token.row, "text": delta, "logprobs": logprobs, "finish_reason": None, **extra}


def _last_choice(job: Job, index: int, sample: Sample, text: _TextFilter) -> dict[str, Any]:
    rest = sample.text[text.sent :] if not (text.silent or text.in_tool) else ""
    extra: dict[str, Any] = {"stop_reason": sample.stop_reason}
    if job.return_token_ids:
        extra["token_logprobs"] = sample.logprobs
        if sample.routed_experts is not None:
            extra["routed_experts"] = encode_experts(sample.routed_experts)
    if not job.chat:
        return {"index": index, "text": rest, "logprobs": None, "finish_reason": sample.finish_reason, **extra}
    reply = job.reply(sample.text)
    delta: dict[str, Any] = {}
    if reply.tool_calls:
        delta["tool_calls"] = [{"index": i, **call.model_dump()} for i, call in enumerate(reply.tool_calls)]
        if text.in_tool and reply.content and len(reply.content) > text.sent:
            delta["content"] = reply.content[text.sent :]
    elif text.in_tool:
        delta["content"] = sample.text[text.sent :]
    elif rest:
        delta["content"] = rest
    choice = _chat_choice(index, delta, **extra)
    choice["finish_reason"] = job.finish_reason(sample.finish_reason, reply)
    return choice
