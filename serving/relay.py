"""The gateway's side of a streamed answer: server-sent events from an engine, passed on to the
client chunk by chunk, with what was served collected for telemetry.

Each chunk is parsed once: Undertow's fields are set (``model``, the session id on a choice's
first chunk), fields the client did not ask for are removed (``token_ids``, ``logprobs``, the
engine's ``routed_experts`` and ``token_logprobs``), and the choice's text, tool calls, token ids
and logprobs are appended to its :class:`serving.turns.Served`. The last chunk of a choice brings
the re-scored logprobs and routed experts, which replace the sampler's. However the stream ends
(finished, the client gone, the engine gone), :meth:`Relay.close` closes the engine's response
(so an engine whose client left stops generating) and hands over what was served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from serving.turns import Served

DONE = b"data: [DONE]\n\n"


@dataclass
class Wants:
    """What the client asked to see of the engine's extras."""

    token_ids: bool = False
    logprobs: bool = False


@dataclass
class Relay:
    """One engine stream being relayed."""

    response: httpx.Response
    lines: AsyncIterator[str]
    chat: bool
    wants: Wants
    model: str
    session_id: Callable[[int], str]
    served: dict[int, Served] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    version: str | None = None
    finished: bool = False

    async def first(self) -> bytes | None:
        """The first data chunk (read before answering, so a failing engine can still be replaced)."""
        async for line in self.lines:
            if line.startswith("data: "):
                return self.transform(line[6:])
        return None

    async def rest(self) -> AsyncIterator[bytes]:
        """The remaining chunks, transformed."""
        async for line in self.lines:
            if line.startswith("data: "):
                out = self.transform(line[6:])
                if out is not None:
                    yield out
                if self.finished:
                    return

    def transform(self, data: str) -> bytes | None:
        if data.strip() == "[DONE]":
            self.finished = True
            return DONE
        chunk = json.loads(data)
        if self.version is None and chunk.get("system_fingerprint"):
            self.version = str(chunk["system_fingerprint"])
        prompt_ids = chunk.pop("prompt_token_ids", None)
        if prompt_ids is not None:
            self.prompt_token_ids = prompt_ids
            if self.wants.token_ids:
                chunk["prompt_token_ids"] = prompt_ids
        if "model" in chunk:
            chunk["model"] = self.model
        for choice in chunk.get("choices") or []:
            self._collect(choice)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def _collect(self, choice: dict[str, Any]) -> None:
        index = int(choice.get("index", 0))
        served = self.served.get(index)
        if served is None:
            served = self.served[index] = Served(index=index)
            choice["session_id"] = self.session_id(index)
        prompt_ids = choice.pop("prompt_token_ids", None)
        if prompt_ids is not None:
            self.prompt_token_ids = prompt_ids
            if self.wants.token_ids:
                choice["prompt_token_ids"] = prompt_ids
        ids = choice.get("token_ids") if self.wants.token_ids else choice.pop("token_ids", None)
        served.token_ids += list(ids or [])
        logprobs = choice.get("logprobs")
        if logprobs:
            if self.chat:
                served.logprobs += [float(item["logprob"]) for item in logprobs.get("content") or []]
            else:
                served.logprobs += [float(x) for x in logprobs.get("token_logprobs") or []]
        if not self.wants.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if self.chat:
            delta = choice.get("delta") or {}
            served.text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                served.tool_calls.append({k: v for k, v in call.items() if k != "index"})
        else:
            served.text += choice.get("text") or ""
        rescored = choice.pop("token_logprobs", None)
        if rescored is not None and len(rescored) == len(served.token_ids):
            served.logprobs = [float(x) for x in rescored]
        experts = choice.pop("routed_experts", None)
        if experts:
            served.routed_experts = experts
        if choice.get("finish_reason"):
            served.finish_reason = str(choice["finish_reason"])

    async def close(self) -> list[Served]:
        """Close the engine's stream; what each choice served (unfinished ones end with ``abort``).

        A finished stream is read to the end of its body first, so the connection to the engine
        goes back to the pool; an unfinished one (the client left) is closed at once, which
        stops the engine's generation.
        """
        if self.finished:
            with contextlib.suppress(httpx.HTTPError, TimeoutError):
                async with asyncio.timeout(1.0):
                    async for _ in self.lines:
                        pass
        await self.response.aclose()
        for served in self.served.values():
            if served.finish_reason is None:
                served.finish_reason = "abort"
        return [self.served[i] for i in sorted(self.served)]
