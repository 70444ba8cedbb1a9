"""Signed versions: the trainer signs each version's manifest with an Ed25519 key, and replicas verify
that signature before they stage anything of the version.

What is signed is the manifest's canonical JSON (sorted keys, no spaces) without its ``signature``
field, after a domain tag. The manifest holds the whole-version hash, every tensor's checksum and,
for what a replica reads, the SHA-256 of each delta payload and of each snapshot tensor: the XXH3
checksums are there for speed and resist no forger, so the signature vouches for the bits through
the SHA-256 digests, which a verifying store checks on every read (:mod:`policy.weights.readers`).

Keys (producer of signatures: the trainer's :class:`SigningKey`; consumer: a replica's :class:`Keyring`):

- the private key, PEM (PKCS#8) at ``policy.weights.signing_key``: created on first use with mode
  0600, or by ``undertow weights keygen``; refused when other users may read it;
- the public keys, PEM blocks in one file at ``policy.weights.public_key``: creating a private key
  appends its public key there. During a rotation the file holds the old key and the new one; a
  replica reads it again when it changes.

Left out: several signatures per manifest (re-signing replaces the one there: ``undertow weights
sign``), and revocation lists (a key is revoked by removing it from the replicas' file).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from policy.config import WeightsConfig
from policy.weights.format import WeightsError

DOMAIN = b"undertow.weights/1 manifest\n"
"""Prefix of every signed message: a signature over anything else never verifies as a manifest's."""
KEYRING_MAX_BYTES = 1 << 20
"""A public key file larger than this is refused (it holds a few keys of a few hundred bytes)."""
_PEM_BLOCK = re.compile(rb"-----BEGIN PUBLIC KEY-----.+?-----END PUBLIC KEY-----", re.DOTALL)


def canonical(data: dict[str, Any]) -> bytes:
    """The bytes a manifest's signature covers: the domain tag, then its JSON without ``signature``."""
    body = {key: value for key, value in data.items() if key != "signature"}
    return DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def key_id(public: Ed25519PublicKey) -> str:
    """A public key's short name: the first 16 hex digits of the SHA-256 of its raw bytes."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(public: Ed25519PublicKey) -> bytes:
    """A public key as a PEM block (SubjectPublicKeyInfo, what ``openssl pkey -pubin`` reads)."""
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


class SigningKey:
    """The trainer's private key at ``path``, created on first use (mode 0600) with its public key
    appended to ``public_path``."""

    def __init__(self, path: str | Path, public_path: str | Path | None = None) -> None:
        self.path = Path(path)
        self.public_path = Path(public_path) if public_path is not None else None
        self._key: Ed25519PrivateKey | None = None

    @classmethod
    def from_config(cls, config: WeightsConfig, home: Path) -> SigningKey:
        """The key ``config.signing_key`` names (relative paths live under ``home``)."""
        return cls(home / config.signing_key, home / config.public_key)

    def exists(self) -> bool:
        return self.path.exists()

    def key(self) -> Ed25519PrivateKey:
        """The private key, loaded (or created, when there is none yet) once."""
        if self._key is None:
            self._key = self._load() if self.path.exists() else self.create()
        return self._key

    @property
    def key_id(self) -> str:
        return key_id(self.key().public_key())

    def create(self, *, replace: bool = False) -> Ed25519PrivateKey:
        """Generate a key and write it with mode 0600 (``replace``: over the one there, a rotation). Another
        process creating one at the same moment wins or loses as a whole: its key is loaded instead."""
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(pem)
                handle.flush()
                os.fsync(handle.fileno())
            if replace:
                os.replace(tmp, self.path)
            else:
                os.link(tmp, self.path)  # fails when the file exists: never overwrite a key by accident
        except FileExistsError:
            self._key = self._load()
            return self._key
        finally:
            tmp.unlink(missing_ok=True)
        self._key = key
        self.publish()
        return key

    def publish(self) -> None:
        """Append the public key to ``public_path`` unless it is there already (the file keeps other keys)."""
        if self.public_path is None:
            return
        public = self.key().public_key()
        if self.public_path.exists() and key_id(public) in Keyring(self.public_path).trusted():
            return
        self.public_path.parent.mkdir(parents=True, exist_ok=True)
        with self.public_path.open("ab") as handle:
            handle.write(public_pem(public))

    def _load(self) -> Ed25519PrivateKey:
        mode = self.path.stat().st_mode & 0o777
        if mode & 0o077:
            raise WeightsError(
                f"the weights signing key {self.path} may be read by other users (mode {mode:o}); "
                f"run `chmod 600 {self.path}` (and consider it leaked if they did)"
            )
        try:
            key = serialization.load_pem_private_key(self.path.read_bytes(), password=None)
        except (ValueError, TypeError) as err:
            raise WeightsError(f"the weights signing key {self.path} is not a readable PEM private key: {err}") from err
        if not isinstance(key, Ed25519PrivateKey):
            raise WeightsError(f"the weights signing key {self.path} is not an Ed25519 key; make one with keygen")
        return key

    def sign(self, data: dict[str, Any]) -> dict[str, str]:
        """The ``signature`` field of a manifest whose JSON data (without signature) is ``data``."""
        key = self.key()
        value = key.sign(canonical(data))
        return {"alg": "ed25519", "key_id": key_id(key.public_key()), "value": base64.b64encode(value).decode()}


class Keyring:
    """The public keys a replica trusts: every PEM block of one file, read again when the file changes.

    ``path`` None: no key configured, and every version is refused (a replica never skips the check)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._stamp: tuple[int, int, int] | None = None
        self._keys: dict[str, Ed25519PublicKey] = {}

    @classmethod
    def from_config(cls, config: WeightsConfig, home: Path) -> Keyring:
        """The keys ``config.public_key`` names (relative paths live under ``home``)."""
        return cls(home / config.public_key)

    def trusted(self) -> dict[str, Ed25519PublicKey]:
        """Trusted keys by key id (raises :class:`WeightsError` saying what to do when there are none)."""
        if self.path is None:
            raise WeightsError(
                "this replica has no public key to verify weights versions with: set policy.weights.public_key "
                "(vLLM: UNDERTOW_WEIGHTS_PUBLIC_KEY) to the trainer's public key file"
            )
        try:
            info = self.path.stat()
        except FileNotFoundError as err:
            raise WeightsError(
                f"the public key file {self.path} does not exist: copy the trainer's public key there "
                "(`undertow weights keygen` on the trainer writes and prints it)"
            ) from err
        stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        if stamp != self._stamp:
            self._keys = self._read(info.st_size)
            self._stamp = stamp
        return self._keys

    @property
    def stamp(self) -> tuple[int, int, int] | None:
        """Changes whenever the trusted keys may have (what verified manifests are cached under)."""
        self.trusted()
        return self._stamp

    def _read(self, size: int) -> dict[str, Ed25519PublicKey]:
        assert self.path is not None
        if size > KEYRING_MAX_BYTES:
            raise WeightsError(
                f"the public key file {self.path} is over {KEYRING_MAX_BYTES} bytes; it is not a key file"
            )
        keys: dict[str, Ed25519PublicKey] = {}
        for block in _PEM_BLOCK.findall(self.path.read_bytes()):
            try:
                public = serialization.load_pem_public_key(block)
            except ValueError as err:
                raise WeightsError(f"the public key file {self.path} holds a block that is not a key: {err}") from err
            if not isinstance(public, Ed25519PublicKey):
                raise WeightsError(f"the public key file {self.path} holds a key that is not Ed25519")
            keys[key_id(public)] = public
        if not keys:
            raise WeightsError(f"the public key file {self.path} holds no PEM public key")
        return keys

    def verify(self, data: dict[str, Any], version: str) -> str:
        """Check the signature of a manifest's parsed JSON; returns the signer's key id, else raises
        :class:`WeightsError` saying why the version is refused and what to do."""
        keys = self.trusted()
        signature = data.get("signature")
        if signature is None:
            raise WeightsError(
                f"version {version} is not signed, and this replica applies only versions signed by a trusted key: "
                "publish versions through the trainer, which signs them, or vouch for this one on the trainer with "
                f"`undertow weights sign {version} --force`"
            )
        if not isinstance(signature, dict) or signature.get("alg") != "ed25519":
            raise WeightsError(f"the signature of version {version} is malformed (not an ed25519 signature object)")
        signer, value = signature.get("key_id"), signature.get("value")
        if not isinstance(signer, str) or not isinstance(value, str) or len(value) > 200:
            raise WeightsError(f"the signature of version {version} is malformed (key_id or value missing)")
        public = keys.get(signer)
        if public is None:
            raise WeightsError(
                f"version {version} is signed by key {signer[:16]!r}, which this replica does not trust "
                f"(it trusts {sorted(keys)} from {self.path}): add that trainer's public key to the file if you "
                "trust it, or have your trainer re-sign the version"
            )
        try:
            public.verify(base64.b64decode(value, validate=True), canonical(data))
        except (InvalidSignature, ValueError) as err:
            raise WeightsError(
                f"the manifest of version {version} does not match its signature (key {signer}): it was changed "
                "after it was signed; refusing it. Restore it from the trainer's store or publish the version again"
            ) from err
        return signer
