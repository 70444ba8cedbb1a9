"""Gateway API keys, one per client integration: create (the key is in the answer, once), list, revoke.

Operators only, each call audited (never the key itself). The gateway accepts a new key, and refuses
a revoked one, within ``serving.gateway.key_refresh_s``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Request, status
from pydantic import BaseModel, ConfigDict, Field

from scheduler.api.deps import EngineDep, OperatorDep, audit
from scheduler.api.schemas import NAME_PATTERN
from serving import keys

router = APIRouter(prefix="/gateway-keys", tags=["gateway-keys"])

Scope = Literal["serve", "metrics"]
KeyName = Annotated[str, Path(min_length=1, max_length=128, pattern=NAME_PATTERN, description="The key's name.")]


class KeyRequest(BaseModel):
    """A new key for one client integration."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN)
    scopes: list[Scope] = Field(default_factory=lambda: list[Scope](["serve"]), min_length=1, max_length=2)
    user_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=NAME_PATTERN)
    rate_per_s: float | None = Field(default=None, gt=0, le=1e6)


class GatewayKey(BaseModel):
    """A key as listed: never the key, only its first characters."""

    name: str
    prefix: str
    scopes: list[str]
    user_id: str | None
    rate_per_s: float | None
    created_at: str
    revoked_at: str | None


class NewGatewayKey(GatewayKey):
    """A key just created: ``key`` is shown this once."""

    key: str


@router.get("", response_model=list[GatewayKey], summary="List gateway keys")
def list_gateway_keys(_: OperatorDep, engine: EngineDep) -> list[GatewayKey]:
    """Every key, revoked ones included, oldest first."""
    return [GatewayKey.model_validate(keys.describe(row)) for row in keys.list_keys(engine)]


@router.post("", response_model=NewGatewayKey, status_code=status.HTTP_201_CREATED, summary="Create a gateway key")
def create_gateway_key(request: Request, _: OperatorDep, engine: EngineDep, body: KeyRequest) -> NewGatewayKey:
    """A key for one client integration; store it at once, it is not shown again."""
    audit(request, "gateway_key.create", name=body.name, scopes=body.scopes, user_id=body.user_id)
    try:
        row, key = keys.create_key(engine, body.name, tuple(body.scopes), body.user_id, body.rate_per_s)
    except ValueError as exc:
        raise HTTPException(409, str(exc)) from exc
    return NewGatewayKey.model_validate({**keys.describe(row), "key": key})


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, summary="Revoke a gateway key")
def revoke_gateway_key(request: Request, _: OperatorDep, engine: EngineDep, name: KeyName) -> None:
    """Revoke the key: the gateway refuses it within ``serving.gateway.key_refresh_s``."""
    audit(request, "gateway_key.revoke", name=name)
    if not keys.revoke_key(engine, name):
        raise HTTPException(404, f"no active gateway key named {name!r}; list them with GET /api/v1/gateway-keys")
