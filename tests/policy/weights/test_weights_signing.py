"""Signed versions: what a replica's store (one with a keyring) accepts and refuses, and what a refused
version leaves behind (nothing staged, the live tensors untouched). Real keys, real stores, real files.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from policy.config import WeightsConfig
from policy.weights import Keyring, SigningKey, WeightsError, WeightStore
from policy.weights.format import (
    FULL_FILE,
    MANIFEST,
    MANIFEST_MAX_BYTES,
    TensorMeta,
    checksum,
    digest,
    version_hash,
)
from policy.weights.tensors import read_header
from serving.protocol import ApplyRequest, PrefetchRequest
from serving.weights import WeightUpdater


def _states(n: int = 3) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    state = {"a": torch.randn(64, 32).to(torch.bfloat16), "b": torch.randn(128).to(torch.bfloat16)}
    out = [state]
    for _ in range(n - 1):
        state = {k: (v.float() + (torch.rand(v.shape) < 0.05) * 0.01).to(torch.bfloat16) for k, v in state.items()}
        out.append(state)
    return out


@pytest.fixture
def published(tmp_path: Path, signer: SigningKey) -> tuple[WeightStore, list[str]]:
    """A store with v000001 (snapshot) and two deltas, signed by the session's key."""
    store = WeightStore(tmp_path / "weights", WeightsConfig(snapshot_every=8), signer=signer)
    return store, [store.put(state).version for state in _states()]


def _replica(store: WeightStore, signer: SigningKey) -> WeightStore:
    """The same store as a replica opens it: every manifest checked against the trainer's public key."""
    return WeightStore(store.url, keyring=Keyring(signer.public_path))


def _edit(store: WeightStore, version: str, change) -> None:  # type: ignore[no-untyped-def]
    path = Path(store.path(version, MANIFEST))
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _refused_and_untouched(store: WeightStore, signer: SigningKey, version: str, reason: str) -> None:
    """A replica holding the first version refuses ``version`` with ``reason``: nothing staged, nothing written."""
    live = {k: v.clone() for k, v in _states()[0].items()}
    updater = WeightUpdater.for_dict(live, version="v000001", store_url=store.url, public_key=signer.public_path)
    hash_before = updater.hash
    with pytest.raises(ValueError, match=reason):
        updater.prefetch(PrefetchRequest(to_version=version))
    assert updater.staged is None
    with pytest.raises(ValueError, match="nothing staged"):
        updater.apply(ApplyRequest(to_version=version, expected_hash=hash_before))
    assert updater.hash == hash_before and updater.version == "v000001"
    assert all(torch.equal(live[k], v) for k, v in _states()[0].items())


def test_signed_round_trip_and_the_key_files(published, signer: SigningKey) -> None:  # type: ignore[no-untyped-def]
    store, versions = published
    replica = _replica(store, signer)
    assert all(replica.manifest(v).signature.key_id == signer.key_id for v in versions)  # type: ignore[union-attr]
    assert stat.S_IMODE(signer.path.stat().st_mode) == 0o600
    assert list(Keyring(signer.public_path).trusted()) == [signer.key_id]
    # A replica moves through the signed deltas bit for bit; its store checks every payload's SHA-256.
    live = {k: v.clone() for k, v in _states()[0].items()}
    updater = WeightUpdater.for_dict(live, version=versions[0], store_url=store.url, public_key=signer.public_path)
    pulled = updater.prefetch(PrefetchRequest(to_version=versions[2], kind="delta"))
    assert pulled["steps"] == [f"delta:{versions[1]}", f"delta:{versions[2]}"]
    updater.apply(ApplyRequest(to_version=versions[2], expected_hash=store.manifest(versions[2]).version_hash))
    assert all(torch.equal(live[k], v) for k, v in _states()[2].items())


def test_a_fresh_home_makes_its_key_pair_on_the_first_put(tmp_path: Path) -> None:
    from policy.config import PolicyConfig
    from policy.weights import open_store

    home = tmp_path / "home"
    config = PolicyConfig()
    version = open_store(config, home).put(_states(1)[0]).version
    key = home / config.weights.signing_key
    assert key.exists() and stat.S_IMODE(key.stat().st_mode) == 0o600
    replica = WeightStore(home / "weights", keyring=Keyring.from_config(config.weights, home))
    assert replica.manifest(version).signature is not None


def test_put_without_a_key_writes_nothing(tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "weights")
    with pytest.raises(WeightsError, match="no signing key"):
        store.put(_states(1)[0], version="v1")
    assert store.version_ids() == []


def test_a_readable_private_key_is_refused(tmp_path: Path) -> None:
    key = SigningKey(tmp_path / "k.pem", tmp_path / "k.pub")
    key.key()
    key.path.chmod(0o644)
    with pytest.raises(WeightsError, match="chmod 600"):
        SigningKey(key.path).key()


def test_tampered_manifest_is_refused(published, signer: SigningKey) -> None:  # type: ignore[no-untyped-def]
    store, versions = published
    _edit(store, versions[1], lambda doc: doc["meta"].update(step=999))
    with pytest.raises(WeightsError, match="does not match its signature"):
        _replica(store, signer).manifest(versions[1])
    _refused_and_untouched(store, signer, versions[1], "changed after it was signed")


def test_tampered_tensor_bytes_with_a_recomputed_checksum_but_the_old_signature(published, signer) -> None:  # type: ignore[no-untyped-def]
    store, _ = published
    target = store.put(_states(4)[3], full=True).version
    # Change the snapshot's bytes of tensor "a" and make the manifest agree (checksum, digest, version hash):
    # every integrity check passes, only the signature (over the old manifest) can tell.
    path = Path(store.path(target, FULL_FILE))
    _dtype, _shape, start, end = read_header(store.fs, str(path))["a"]
    raw = bytearray(path.read_bytes())
    raw[start] ^= 0x40
    path.write_bytes(bytes(raw))
    forged = bytes(raw[start:end])

    def recompute(doc: dict) -> None:  # type: ignore[type-arg]
        doc["tensors"]["a"]["checksum"] = checksum(forged)
        doc["full"]["sha256"]["a"] = digest(forged)
        doc["version_hash"] = version_hash({n: TensorMeta(**t) for n, t in doc["tensors"].items()})

    _edit(store, target, recompute)
    assert store.open_full(target).words("a").tobytes() == forged  # consistent for a checksum-only reader
    with pytest.raises(WeightsError, match="does not match its signature"):
        _replica(store, signer).manifest(target)
    _refused_and_untouched(store, signer, target, "does not match its signature")


class _AnyXxh3(str):
    """A checksum equal to every other: what a forger who matches XXH3 achieves."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = str.__hash__


def test_bytes_that_keep_their_xxh3_are_still_caught_by_the_signed_sha256(published, signer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """XXH3 is no defence against a forger; the signed manifest's SHA-256 of each payload is. Forged
    payloads whose XXH3 matches (simulated: every XXH3 comparison of the reader passes) are refused."""
    import policy.weights.readers as readers

    store, versions = published
    path = Path(store.path(versions[1], "delta.bin"))
    path.write_bytes(bytes(b ^ 0x01 for b in path.read_bytes()))
    monkeypatch.setattr(readers, "checksum", lambda data: _AnyXxh3())
    names = list(store.manifest(versions[1]).tensors)
    with store.open_delta(versions[1]) as reader:  # a reader that checks only XXH3 takes the forgery
        assert all(reader.payload(name) for name in names)
    with _replica(store, signer).open_delta(versions[1]) as reader:
        for name in names:
            with pytest.raises(WeightsError, match="corrupt"):
                reader.payload(name)


def test_a_version_signed_by_another_key_is_refused(published, signer: SigningKey, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, _ = published
    stranger = SigningKey(tmp_path / "other.pem", tmp_path / "other.pub")
    foreign = WeightStore(store.url, store.config, signer=stranger).put(_states(4)[3]).version
    with pytest.raises(WeightsError, match=f"signed by key '{stranger.key_id}', which this replica does not trust"):
        _replica(store, signer).manifest(foreign)
    _refused_and_untouched(store, signer, foreign, "does not trust")


def test_an_unsigned_version_is_refused(published, signer: SigningKey) -> None:  # type: ignore[no-untyped-def]
    store, versions = published
    _edit(store, versions[2], lambda doc: doc.pop("signature"))
    assert store.manifest(versions[2]).signature is None  # a well-formed manifest, only unsigned
    with pytest.raises(WeightsError, match="is not signed"):
        _replica(store, signer).manifest(versions[2])
    _refused_and_untouched(store, signer, versions[2], "is not signed")
    # Without the trainer's public key a replica refuses everything, and says what to do.
    with pytest.raises(WeightsError, match="no public key"):
        WeightStore(store.url, keyring=Keyring(None)).manifest(versions[0])
    with pytest.raises(WeightsError, match="does not exist"):
        WeightStore(store.url, keyring=Keyring(Path(store.root) / "nothing.pub")).manifest(versions[0])


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"{", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b'["a", "list"]', "not a JSON object"),
        (b'{"version": "v000002", "signature": {"alg": "ed25519", "key_id": "0", "value": 5}}', "malformed"),
        (b"", "not valid JSON"),
    ],
)
def test_hostile_manifests_are_refused(published, signer: SigningKey, content: bytes, reason: str) -> None:  # type: ignore[no-untyped-def]
    store, versions = published
    Path(store.path(versions[1], MANIFEST)).write_bytes(content)
    with pytest.raises(WeightsError):
        store.manifest(versions[1])
    with pytest.raises(WeightsError, match=reason):
        _replica(store, signer).manifest(versions[1])
    assert [h.version for h in store.heads()] == [versions[0], versions[2]]  # planning skips it
    _refused_and_untouched(store, signer, versions[1], reason)


def test_an_oversized_manifest_is_refused_unparsed(published, signer: SigningKey) -> None:  # type: ignore[no-untyped-def]
    store, versions = published
    with Path(store.path(versions[1], MANIFEST)).open("wb") as handle:
        handle.write(b'{"pad": "' + b" " * MANIFEST_MAX_BYTES + b'"}')
    for reader in (store, _replica(store, signer)):
        with pytest.raises(WeightsError, match="over"):
            reader.manifest(versions[1])


def test_key_rotation_keeps_old_versions_valid_until_they_are_signed_again(published, signer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store, versions = published
    pub = tmp_path / "rotated.pub"
    pub.write_bytes(signer.public_path.read_bytes())
    old = SigningKey(tmp_path / "rotated.pem", pub)
    old.path.write_bytes(signer.path.read_bytes())
    old.path.chmod(0o600)
    trainer = WeightStore(store.url, store.config, signer=old)
    old_id = old.key_id
    old.create(replace=True)  # `undertow weights keygen --rotate`: a new key, both public keys trusted
    new_id = old.key_id
    trusted = Keyring(pub)
    assert sorted(trusted.trusted()) == sorted([old_id, new_id])
    newest = trainer.put(_states(4)[3]).version
    replica = WeightStore(store.url, keyring=trusted)
    assert {replica.manifest(v).signature.key_id for v in [*versions, newest]} == {old_id, new_id}  # type: ignore[union-attr]
    # A manifest changed since it was signed is never signed again; an artifact changed neither.
    _edit(store, versions[1], lambda doc: doc["meta"].update(step=1))
    with pytest.raises(WeightsError, match="does not match its signature"):
        trainer.sign(versions[1], trusted=trusted)
    _edit(store, versions[1], lambda doc: doc["meta"].pop("step"))
    path = Path(store.path(versions[1], "delta.bin"))
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(WeightsError, match="corrupt"):
        trainer.sign(versions[1], trusted=trusted)
    path.write_bytes(good)
    for version in versions:
        assert trainer.sign(version, trusted=trusted).signature.key_id == new_id  # type: ignore[union-attr]
    # The old key leaves the replicas' file: every retained version still verifies, by the new key.
    pub.write_bytes(b"".join(_pem(Keyring(pub), new_id)))
    assert list(Keyring(pub).trusted()) == [new_id]
    assert {replica.manifest(v).signature.key_id for v in [*versions, newest]} == {new_id}  # type: ignore[union-attr]
    live = {k: v.clone() for k, v in _states()[0].items()}
    updater = WeightUpdater.for_dict(live, version=versions[0], store_url=store.url, public_key=pub)
    updater.prefetch(PrefetchRequest(to_version=versions[2]))
    updater.apply(ApplyRequest(to_version=versions[2], expected_hash=store.manifest(versions[2]).version_hash))
    assert all(torch.equal(live[k], v) for k, v in _states()[2].items())


def _pem(ring: Keyring, key_id: str) -> list[bytes]:
    from policy.weights.signing import public_pem

    return [public_pem(ring.trusted()[key_id])]


def test_vouching_for_an_unsigned_version_needs_force(published, signer: SigningKey) -> None:  # type: ignore[no-untyped-def]
    store, versions = published
    _edit(store, versions[0], lambda doc: doc.pop("signature"))
    with pytest.raises(WeightsError, match="is not signed"):
        store.sign(versions[0], trusted=Keyring(signer.public_path))
    assert store.sign(versions[0]).signature is not None  # the operator vouches (`sign --force`)
    assert _replica(store, signer).manifest(versions[0]).signature.key_id == signer.key_id  # type: ignore[union-attr]
