"""Which editor signals the gateway trusts, before they reach Kafka or the deployment gate.

A signal moves labels, reward models and the canary gate, so the gateway refuses the ones no
honest client sends, each with a clear 4xx and a reason counted in ``/gateway/metrics``:

- ``occurred_at`` later than now plus ``signal_max_skew_s``: a signal dated in the future would
  override the real one (labels keep the latest ``occurred_at``). 422.
- a signal naming a user other than the one the gateway served that session to: 403. A signal
  that names no user is attributed to the served one.
- a signal sent with another client's key than the one the session was served through: 403 (a
  client integration vouches only for its own users).
- ``user.churned`` for a user this client was never seen serving (a key bound to one user may
  only say that user churned): 403.
- a request that names, as its agent session, a session served to another user: 409 (clients choose
  their session ids; the first user to use one keeps it).

An ``event_id`` the gateway has forwarded already is answered 200 with ``duplicate: true`` and
neither forwarded nor counted again (ingest de-duplicates too; the gate's counts now do as well).
Signals for sessions this gateway did not serve (another gateway, or before a restart) are
forwarded as before: ingest joins them when their session arrives; the gate does not count them.

What the gateway remembers is bounded (the newest sessions and event ids), so a restart or a very
old session falls back to ingest's checks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

MAX_REMEMBERED = 100_000
"""Sessions, and separately event ids, the gateway remembers (the oldest are forgotten first)."""


@dataclass(frozen=True)
class Refusal:
    """Why a signal is refused: the HTTP status, the error type counted in the metrics, the message."""

    status: int
    kind: str
    message: str


MIXED = "<mixed>"
"""The version of a session whose turns several versions served (after a rollout or a rollback mid-session)."""


def remember(store: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """Put ``key`` in ``store`` as its most recent entry, forgetting the oldest past ``MAX_REMEMBERED``."""
    store[key] = value
    store.move_to_end(key)
    while len(store) > MAX_REMEMBERED:
        store.popitem(last=False)


class SignalTrust:
    """The sessions this gateway served (version and user) and the event ids it forwarded."""

    def __init__(self, max_skew_s: float) -> None:
        self.max_skew = timedelta(seconds=max_skew_s)
        self.sessions: OrderedDict[str, tuple[str, str | None, str | None]] = OrderedDict()
        self.forwarded: OrderedDict[str, None] = OrderedDict()
        self.users: OrderedDict[tuple[str | None, str], None] = OrderedDict()

    def served(self, session_id: str, version: str, user: str | None, client: str | None = None) -> None:
        """Remember that ``session_id`` was served by ``version`` to ``user`` through ``client``; a
        multi-turn session whose turns were served by more than one version is remembered as
        :data:`MIXED` (what its user thinks of it judges no single version)."""
        entry = self.sessions.get(session_id)
        if entry is not None and entry[0] != version:
            version = MIXED
        remember(self.sessions, session_id, (version, user, client))
        if user is not None:
            remember(self.users, (client, user), None)

    def owner(self, session_id: str) -> str | None:
        """The user ``session_id`` was served to, if this gateway served it to a named user."""
        entry = self.sessions.get(session_id)
        return entry[1] if entry is not None else None

    def claim(self, session_id: str | None, user: str | None) -> Refusal | None:
        """A refusal when ``user`` names as its agent session one served to another user."""
        if session_id is None:
            return None
        owner = self.owner(session_id)
        if owner is not None and owner != user:
            return Refusal(
                409,
                "SessionOfAnotherUser",
                f"session {session_id} belongs to another user; start a new session id for this conversation",
            )
        return None

    def version(self, session_id: str | None) -> str | None:
        """The version that served ``session_id``, if this gateway served it (:data:`MIXED` when several did)."""
        entry = self.sessions.get(session_id or "")
        return entry[0] if entry is not None else None

    def duplicate(self, event_id: str) -> bool:
        """True when this ``event_id`` was forwarded already."""
        return event_id in self.forwarded

    def check(
        self,
        raw: dict[str, Any],
        occurred_at: datetime,
        now: datetime | None = None,
        client: str | None = None,
        key_user: str | None = None,
    ) -> Refusal | None:
        """A refusal for this signal, or None; fills in the served user when the signal names none.

        ``client`` is the name of the key the signal came with and ``key_user`` the user that key
        is bound to (None for a client-wide key, or when the gateway runs without keys).
        """
        now = now or datetime.now(UTC)
        if occurred_at > now + self.max_skew:
            return Refusal(
                422,
                "SignalFromTheFuture",
                f"occurred_at {occurred_at.isoformat()} is later than the gateway's clock plus the allowed skew "
                f"({self.max_skew.total_seconds():g} s); send the time the user acted",
            )
        if key_user is not None:
            if raw.get("user_id") not in (None, key_user):
                return Refusal(
                    403, "SignalFromAnotherUser", f"this key speaks for user {key_user} only, not {raw['user_id']}"
                )
            raw["user_id"] = key_user
        churn = raw.get("type") == "user.churned" and client is not None and key_user is None
        if churn and (client, raw.get("user_id")) not in self.users:
            return Refusal(
                403,
                "ChurnForUnknownUser",
                f"user {raw.get('user_id')} was never served through client {client}; "
                "a client may report churn only for its own users",
            )
        entry = self.sessions.get(str(raw.get("session_id") or ""))
        if entry is not None and client is not None and entry[2] not in (None, client):
            return Refusal(
                403,
                "SignalFromAnotherClient",
                f"session {raw['session_id']} was served through another client; only that client may send its signals",
            )
        if entry is not None and entry[1] is not None:
            user = raw.get("user_id")
            if user is None:
                raw["user_id"] = entry[1]
            elif user != entry[1]:
                return Refusal(
                    403,
                    "SignalFromAnotherUser",
                    f"session {raw['session_id']} was not served to user {user}; only its user may send its signals",
                )
        return None

    def accepted(self, event_id: str) -> None:
        """Remember a forwarded ``event_id``."""
        remember(self.forwarded, event_id, None)
