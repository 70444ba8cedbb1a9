"""The API's edges: the rate limit per client address (behind trusted proxies only) and per valid token,
CSRF on the login and logout forms, refused requests in the audit log (attributed to a valid token's
owner), token expiry and a throttled ``last_used_at``, and the audit log's retention."""

from __future__ import annotations

import re
import secrets
import uuid
from datetime import UTC, datetime, timedelta

from api_helpers import auth
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from ingest.db import transaction
from scheduler.api.tables import ApiTokenRow, AuditRow


def _bogus() -> str:
    return "ut_" + secrets.token_urlsafe(32)


def _address() -> str:
    """A client address of the test's own, so rows and buckets of other tests never mix in."""
    n = uuid.uuid4().int
    return f"198.18.{n % 250}.{(n >> 8) % 250 + 1}"


def _audit(engine: Engine, client: str) -> list[AuditRow]:
    with transaction(engine) as session:
        return list(session.scalars(select(AuditRow).where(AuditRow.client == client).order_by(AuditRow.id)))


def test_random_bogus_tokens_share_their_address_bucket(
    app_factory, api_engine: Engine, tokens: dict[str, str]
) -> None:  # type: ignore[no-untyped-def]
    app = app_factory(rate_limit_per_minute=1, rate_limit_burst=3)
    addr = _address()
    with TestClient(app, client=(addr, 1234)) as c:
        codes = [c.get("/api/v1/jobs", headers=auth(_bogus())).status_code for _ in range(5)]
        assert codes == [401, 401, 401, 429, 429]
        assert c.get("/api/v1/jobs").status_code == 429  # no token: the same address bucket
        # A valid token has its own bucket, so the address's exhaustion does not lock out a real operator.
        assert c.get("/api/v1/jobs", headers=auth(tokens["viewer"])).status_code == 200
    with TestClient(app, client=(_address(), 1234)) as other:
        assert other.get("/api/v1/jobs", headers=auth(_bogus())).status_code == 401
    rows = _audit(api_engine, addr)
    assert [r.status_code for r in rows].count(401) == 3
    assert [r.status_code for r in rows].count(429) == 1  # the first refusal per bucket and minute only


def test_a_valid_token_is_limited_by_its_own_bucket(app_factory, api_engine: Engine) -> None:  # type: ignore[no-untyped-def]
    from scheduler.api.auth import create_token

    _, token = create_token(api_engine, f"rl-{uuid.uuid4().hex[:8]}", "viewer")
    app = app_factory(rate_limit_per_minute=1, rate_limit_burst=2)
    with TestClient(app, client=(_address(), 1)) as a, TestClient(app, client=(_address(), 2)) as b:
        assert a.get("/api/v1/jobs", headers=auth(token)).status_code == 200
        assert b.get("/api/v1/jobs", headers=auth(token)).status_code == 200  # same token, other address
        assert a.get("/api/v1/jobs", headers=auth(token)).status_code == 429


def test_forwarded_for_is_honoured_only_from_trusted_proxies(app_factory, api_engine: Engine) -> None:  # type: ignore[no-untyped-def]
    app = app_factory(rate_limit_per_minute=1, rate_limit_burst=2, trusted_proxies=["10.9.0.0/16"])
    first, second = _address(), _address()
    with TestClient(app, client=("10.9.0.7", 1)) as proxy:
        for _ in range(2):
            assert proxy.get("/api/v1/jobs", headers={"X-Forwarded-For": first}).status_code == 401
        assert proxy.get("/api/v1/jobs", headers={"X-Forwarded-For": first}).status_code == 429
        # A client cannot pick its address by prepending one: the rightmost untrusted entry counts.
        spoof = {"X-Forwarded-For": f"{second}, {first}"}
        assert proxy.get("/api/v1/jobs", headers=spoof).status_code == 429
        assert proxy.get("/api/v1/jobs", headers={"X-Forwarded-For": second}).status_code == 401
    assert {r.client for r in _audit(api_engine, first)} == {first}
    untrusted = _address()
    with TestClient(app, client=(untrusted, 1)) as direct:  # not a proxy: its header is ignored
        codes = [direct.get("/api/v1/jobs", headers={"X-Forwarded-For": _address()}).status_code for _ in range(3)]
    assert codes == [401, 401, 429]


def _csrf(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, "the form carries no CSRF token"
    return match.group(1)


def test_login_and_logout_need_the_csrf_token(client: TestClient, api_engine: Engine) -> None:
    from scheduler.api.auth import create_token

    # A token of this test's own, so its audit entries never mix with the other tests' counts.
    tokens = {"viewer": create_token(api_engine, f"csrf-{uuid.uuid4().hex[:8]}", "viewer")[1]}
    client.cookies.clear()
    page = client.get("/login")
    field = _csrf(page.text)
    assert client.cookies.get("undertow_csrf") == field
    for form in ({"token": tokens["viewer"]}, {"token": tokens["viewer"], "csrf_token": "x" * 43}):
        refused = client.post("/login", data=form, follow_redirects=False)
        assert refused.status_code == 403 and "undertow_session" not in refused.cookies
    client.cookies.delete("undertow_csrf")
    forged = client.post("/login", data={"token": tokens["viewer"], "csrf_token": field}, follow_redirects=False)
    assert forged.status_code == 403  # the field alone, without the cookie (another site's form)
    client.get("/login")
    field = client.cookies["undertow_csrf"]
    ok = client.post("/login", data={"token": tokens["viewer"], "csrf_token": field}, follow_redirects=False)
    assert ok.status_code == 303 and client.cookies.get("undertow_session") == tokens["viewer"]
    assert client.cookies["undertow_csrf"] != field  # rotated at login
    overview = client.get("/")
    assert overview.status_code == 200
    field = _csrf(overview.text)
    assert client.post("/logout", data={}, follow_redirects=False).status_code == 403
    assert client.get("/").status_code == 200  # still logged in
    out = client.post("/logout", data={"csrf_token": field}, follow_redirects=False)
    assert out.status_code == 303 and not out.cookies.get("undertow_session")
    many = client.post(
        "/login",
        content="&".join(f"f{i}=1" for i in range(50)),
        follow_redirects=False,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert many.status_code == 403
    client.cookies.clear()


def test_refused_requests_are_audited_with_their_status(
    app_factory,
    api_engine: Engine,
    tokens: dict[str, str],  # type: ignore[no-untyped-def]
) -> None:
    app = app_factory(max_body_bytes=1000)
    addr = _address()
    with TestClient(app, client=(addr, 1)) as c:
        assert c.post("/api/v1/jobs/retrains", content=b"x" * 5000, headers=auth(tokens["operator"])).status_code == 413
        assert c.get("/api/v1/audit", headers=auth(tokens["viewer"])).status_code == 403
        assert c.get("/api/v1/audit", headers=auth(_bogus())).status_code == 401
        malformed = c.post(
            "/api/v1/gateway-keys",
            content=b'{"name": ',
            headers={**auth(tokens["operator"]), "content-type": "application/json"},
        )
        assert malformed.status_code == 422
        assert c.get("/api/v1/jobs", headers=auth(tokens["viewer"])).status_code == 200  # not a refusal
    rows = {(r.status_code, r.method): r for r in _audit(api_engine, addr)}
    assert set(rows) == {(413, "POST"), (403, "GET"), (401, "GET"), (422, "POST")}
    assert rows[(413, "POST")].actor == "test-operator"
    assert rows[(403, "GET")].actor == "test-viewer"
    assert rows[(401, "GET")].actor == "anonymous" and rows[(401, "GET")].detail.get("token") == "invalid"
    assert rows[(422, "POST")].actor == "test-operator" and rows[(422, "POST")].role == "operator"


def test_expired_tokens_are_refused_and_last_use_is_throttled(app_factory, api_engine: Engine) -> None:  # type: ignore[no-untyped-def]
    from scheduler.api.auth import create_token

    name = f"exp-{uuid.uuid4().hex[:8]}"
    row, token = create_token(api_engine, name, "viewer", ttl_days=30)
    assert row.expires_at is not None and row.expires_at > datetime.now(UTC) + timedelta(days=29)

    def last_used() -> datetime | None:
        with transaction(api_engine) as session:
            return session.scalar(select(ApiTokenRow.last_used_at).where(ApiTokenRow.name == name))

    with TestClient(app_factory(token_touch_interval_s=3600)) as c:
        assert last_used() is None
        assert c.get("/api/v1/jobs", headers=auth(token)).status_code == 200
        first = last_used()
        assert first is not None
        assert c.get("/api/v1/jobs", headers=auth(token)).status_code == 200
        assert last_used() == first  # within the interval: not written again
    with TestClient(app_factory(token_touch_interval_s=0)) as c:
        assert c.get("/api/v1/jobs", headers=auth(token)).status_code == 200
        second = last_used()
        assert second is not None and second > first
        with transaction(api_engine) as session:
            session.execute(
                update(ApiTokenRow)
                .where(ApiTokenRow.name == name)
                .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
            )
        refused = c.get("/api/v1/jobs", headers=auth(token))
        assert refused.status_code == 401 and "expired" in refused.json()["detail"]
        login = c.get("/login")
        denied = c.post("/login", data={"token": token, "csrf_token": _csrf(login.text)}, follow_redirects=False)
        assert denied.status_code == 401
    import pytest

    with pytest.raises(ValueError, match="lifetime"):
        create_token(api_engine, f"bad-{uuid.uuid4().hex[:8]}", "viewer", ttl_days=-1)


def test_audit_retention_prunes_old_entries(api_engine: Engine) -> None:
    from scheduler.api.auth import record_audit
    from scheduler.privacy import enforce_retention
    from scheduler.settings import Settings

    addr = _address()
    record_audit(
        api_engine, actor="a", role="operator", method="POST", path="/x", action="old", status_code=200, client=addr
    )
    record_audit(
        api_engine, actor="a", role="operator", method="POST", path="/x", action="new", status_code=200, client=addr
    )
    with transaction(api_engine) as session:
        session.execute(
            update(AuditRow)
            .where(AuditRow.client == addr, AuditRow.action == "old")
            .values(occurred_at=datetime.now(UTC) - timedelta(days=400))
        )
    settings = Settings(api={"audit_retention_days": 365}, ingest={"retention_days": 0})
    out = enforce_retention(api_engine, settings)
    assert out["audit"] >= 1 and out["telemetry"] is None
    assert [r.action for r in _audit(api_engine, addr)] == ["new"]
