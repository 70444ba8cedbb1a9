"""An optional LLM-as-judge signal: a rubric scored by any OpenAI-compatible endpoint.

One dimension per call (``POST {base_url}/chat/completions``, temperature 0): the judge reads
the request, the answer and one rubric line and answers with a score from 0 to 10, mapped to
0..1 and stored as the label ``judge:<dimension>``. Scores are cached in ``reward_judge_cache``
by the SHA-256 of (model, dimension, rubric, prompt, completion), so a relabeling run asks only
about new content. A call that fails or an answer without a score is skipped and counted: the
judge is an optional signal and never stops training. Off by default (``JudgeConfig.enabled``).
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Any

import httpx
import pandas as pd
import structlog
from sqlalchemy import select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from reward_models.config import JudgeConfig
from reward_models.tables import JudgeScoreRow

log = structlog.get_logger(__name__)

SYSTEM = (
    "You grade one answer of a coding assistant on exactly one rubric dimension. "
    "Reply with a single integer from 0 to 10 and nothing else."
)
_SCORE = re.compile(r"(?<![\d.])(10|[0-9])(?![\d.])")
MAX_CHARS = 20_000


def content_hash(model: str, dimension: str, rubric: str, prompt: str, completion: str) -> str:
    """Cache key of one judgment."""
    raw = json.dumps([model, dimension, rubric, prompt, completion], ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()


def parse_score(text: str) -> float | None:
    """The first integer 0..10 in the judge's reply, mapped to 0..1; None when there is none."""
    match = _SCORE.search(text or "")
    return int(match.group(1)) / 10.0 if match else None


def request_body(config: JudgeConfig, rubric: str, prompt: str, completion: str) -> dict[str, Any]:
    """The chat completions request of one judgment (texts truncated to ``MAX_CHARS``)."""
    user = f"Rubric: {rubric}\n\nRequest:\n{prompt[:MAX_CHARS]}\n\nAnswer:\n{completion[:MAX_CHARS]}\n\nScore (0-10):"
    return {
        "model": config.model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "temperature": 0,
        "max_tokens": 4,
    }


def ask(client: httpx.Client, config: JudgeConfig, rubric: str, prompt: str, completion: str) -> float | None:
    """One judge call; None when the call failed or the reply holds no score."""
    try:
        resp = client.post("/chat/completions", json=request_body(config, rubric, prompt, completion))
        resp.raise_for_status()
        content = resp.json()["choices"][0]["message"]["content"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        log.warning("judge call failed", error=f"{exc.__class__.__name__}: {exc}"[:300])
        return None
    return parse_score(content if isinstance(content, str) else "")


def make_client(config: JudgeConfig) -> httpx.Client:
    """HTTP client for the judge endpoint."""
    headers = {"Authorization": f"Bearer {config.api_key.get_secret_value()}"} if config.api_key else {}
    return httpx.Client(base_url=config.base_url.rstrip("/"), timeout=config.timeout_s, headers=headers)


def judge_sessions(
    engine: Engine, sessions: pd.DataFrame, config: JudgeConfig, client: httpx.Client | None = None
) -> tuple[pd.DataFrame, dict[str, int]]:
    """Scores ``judge:<dimension>`` per session (index ``session_id``) and call statistics."""
    stats = {"judge_calls": 0, "judge_cached": 0, "judge_failed": 0, "judge_skipped_no_text": 0}
    frame = sessions.head(config.max_sessions)
    out = pd.DataFrame(index=pd.Index(frame["session_id"], name="session_id"))
    if frame.empty or not config.dimensions:
        return out, stats
    keys: dict[tuple[str, str], str] = {}
    for sid, prompt, completion in zip(
        frame["session_id"], frame["prompt_text"], frame["completion_text"], strict=True
    ):
        if not str(completion or "").strip():
            stats["judge_skipped_no_text"] += 1
            continue
        for dim, rubric in config.dimensions.items():
            keys[(sid, dim)] = content_hash(config.model, dim, rubric, str(prompt or ""), str(completion))
    cached: dict[str, float] = {}
    wanted = list(set(keys.values()))
    with engine.connect() as conn:
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            rows = conn.execute(
                select(JudgeScoreRow.content_hash, JudgeScoreRow.score).where(JudgeScoreRow.content_hash.in_(chunk))
            )
            cached.update({h: float(s) for h, s in rows})
    texts = frame.set_index("session_id")[["prompt_text", "completion_text"]]
    own_client = client is None
    client = client or make_client(config)
    fresh: dict[str, tuple[str, float]] = {}
    try:
        for (sid, dim), key in keys.items():
            if key in cached:
                stats["judge_cached"] += 1
            elif key not in fresh:
                stats["judge_calls"] += 1
                prompt, completion = texts.loc[sid, "prompt_text"], texts.loc[sid, "completion_text"]
                score = ask(client, config, config.dimensions[dim], str(prompt or ""), str(completion))
                if score is None:
                    stats["judge_failed"] += 1
                    continue
                fresh[key] = (dim, score)
            value = cached.get(key, fresh[key][1] if key in fresh else None)
            out.loc[sid, f"judge:{dim}"] = value
    finally:
        if own_client:
            client.close()
    if fresh:
        now = datetime.now(UTC)
        with transaction(engine) as session:
            existing = set(
                session.execute(
                    select(JudgeScoreRow.content_hash).where(JudgeScoreRow.content_hash.in_(list(fresh)))
                ).scalars()
            )
            for key, (dim, score) in fresh.items():
                if key not in existing:
                    session.add(
                        JudgeScoreRow(content_hash=key, dimension=dim, model=config.model, score=score, created_at=now)
                    )
    return out.astype(float), stats
