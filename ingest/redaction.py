"""Secrets redacted from prompts and code before they are stored, with Yelp's ``detect-secrets``.

A :class:`Redactor` runs the library's detectors (AWS keys, private keys, GitHub, GitLab, Slack,
Stripe, OpenAI and other tokens, ``password = "..."`` keywords, JWTs, basic-auth URLs, and
high-entropy base64 and hex strings) line by line, with the library's own false-positive
heuristics (sequential strings, UUIDs, templates, ``$VARIABLES``, indirect references), and
replaces each secret found with a marker such as ``[REDACTED:AWS Access Key]``. A private key is
redacted from its ``BEGIN`` line through its ``END`` line (to the end of the text when the key
was cut off), since the detector only flags the header.

What is left out: the detectors' network verification (a secret is never sent anywhere), and
per-file-type keyword rules (text arrives without a file name; the generic rules are used).

Cost: the detectors are regular expressions run per line and per detector, about 0.3 ms a line.
A cheap pre-filter (:data:`SUSPECT`) passes on only the lines that could hold a secret (a long
token, a secret-like keyword, a key header or credentials in a URL), so ordinary code costs one
regular-expression scan.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ingest.config import RedactionConfig

SUSPECT = re.compile(
    r"[A-Za-z0-9+/=_\-]{16,}"
    r"|(?i:secret|passw|pwd|token|api[_-]?key|auth|credential|private|bearer)"
    r"|-----BEGIN"
    r"|://[^\s/:@]+:[^\s/@]+@"
)
"""A line that could hold a secret; only these lines are given to the detectors."""
PRIVATE_KEY = "Private Key"
_END_KEY = re.compile(r"-----END[ A-Z0-9]*-----")
_ENTROPY_LIMITS = {"Base64 High Entropy String": "base64_limit", "Hex High Entropy String": "hex_limit"}
_FILENAME = "telemetry"


@dataclass(frozen=True)
class RedactionSpec:
    """What to redact (picklable: the ingest writer processes get it with their batch context)."""

    marker: str = "[REDACTED:{type}]"
    """Replacement of a secret; ``{type}`` is the detector's name (``AWS Access Key``, ...)."""
    disabled: tuple[str, ...] = ("Public IP (ipv4)",)
    """Detector names (``detect-secrets`` secret types) not run (an address in code is not a secret)."""
    base64_limit: float = 4.5
    """Shannon entropy above which a quoted base64 string is a secret (the library's default)."""
    hex_limit: float = 3.0
    """Shannon entropy above which a quoted hex string is a secret (the library's default)."""


def spec_of(config: RedactionConfig) -> RedactionSpec | None:
    """The spec of a config section (None when redaction is off)."""
    if not config.enabled:
        return None
    return RedactionSpec(
        marker=config.marker,
        disabled=tuple(config.disabled_detectors),
        base64_limit=config.base64_entropy_limit,
        hex_limit=config.hex_entropy_limit,
    )


@cache
def redactor_for(spec: RedactionSpec) -> Redactor:
    """One redactor per spec and process (its detectors are built once)."""
    return Redactor(spec)


def detector_names() -> list[str]:
    """Every detector ``detect-secrets`` ships (the names :attr:`RedactionSpec.disabled` takes)."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

    return sorted(get_mapping_from_secret_type_to_class())


def _values(plugin: Any, line: str) -> list[str]:
    """The secrets one detector finds in ``line``.

    A pattern detector reports the first capture group when its pattern has one, which for some is the
    secret (``aws...key = "(...)"``) and for others only its prefix (GitHub's ``(ghp|gho|...)_...``): here
    a group counts when it is at least 8 characters, else the whole match, without its delimiters. The
    library's "indirect reference" filter (``secret = get_secret(...)``) applies to the keyword and entropy
    detectors only: a token of a known format is a secret wherever it stands.
    """
    from detect_secrets.filters.heuristic import is_indirect_reference
    from detect_secrets.plugins.base import RegexBasedDetector

    if not isinstance(plugin, RegexBasedDetector):  # keywords and entropy: not ``key = get_key(...)``
        if is_indirect_reference(line):
            return []
        return [hit.secret_value for hit in plugin.analyze_line(filename=_FILENAME, line=line, line_number=0)]
    values = []
    for pattern in plugin.denylist:
        for match in pattern.finditer(line):
            groups = [g for g in match.groups() if g and len(g) >= 8]
            values.append(max(groups, key=len) if groups else match.group(0).strip(" \t=:\"'"))
    return values


class Redactor:
    """Replaces the secrets in a text with markers (see the module docstring)."""

    def __init__(self, spec: RedactionSpec) -> None:
        unknown = set(spec.disabled) - set(detector_names())
        if unknown:
            raise ValueError(f"unknown secret detectors {sorted(unknown)}: use names from {detector_names()}")
        self.spec = spec

    @cached_property
    def _plugins(self) -> list[Any]:
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

        plugins: list[Any] = []
        cls: Any
        for name, cls in sorted(get_mapping_from_secret_type_to_class().items()):
            if name in self.spec.disabled:
                continue
            limit = _ENTROPY_LIMITS.get(name)
            plugins.append(cls(limit=getattr(self.spec, limit)) if limit else cls())
        # Known formats first, so a GitHub token is named as one rather than as a high-entropy string.
        from detect_secrets.plugins.base import RegexBasedDetector

        return sorted(plugins, key=lambda p: not isinstance(p, RegexBasedDetector))

    @cached_property
    def _false_positive(self) -> Callable[[str, str, Any], bool]:
        from detect_secrets.filters import heuristic

        def check(secret: str, line: str, plugin: Any) -> bool:
            return (
                heuristic.is_sequential_string(secret)
                or heuristic.is_potential_uuid(secret)
                or heuristic.is_likely_id_string(secret, line, plugin)
                or heuristic.is_templated_secret(secret)
                or heuristic.is_prefixed_with_dollar_sign(secret)
                or heuristic.is_not_alphanumeric_string(secret)
            )

        return check

    def find(self, line: str) -> list[tuple[str, str]]:
        """``(type, secret)`` of each secret in one line, longest first."""
        if not SUSPECT.search(line):
            return []
        found: dict[str, str] = {}
        for plugin in self._plugins:
            for value in _values(plugin, line):
                if value and not self._false_positive(value, line, plugin):
                    found.setdefault(value, plugin.secret_type)
        return sorted(((t, s) for s, t in found.items()), key=lambda item: -len(item[1]))

    def redact(self, text: str) -> str:
        """``text`` with every secret found replaced by the marker (unchanged when there is none)."""
        if not SUSPECT.search(text):
            return text
        lines = text.split("\n")
        out: list[str] = []
        in_key = False
        for line in lines:
            if in_key:
                if _END_KEY.search(line):
                    in_key = False
                continue
            hits = self.find(line)
            if any(kind == PRIVATE_KEY for kind, _ in hits):
                out.append(self.spec.marker.format(type=PRIVATE_KEY))
                in_key = not _END_KEY.search(line)
                continue
            for kind, secret in hits:
                line = line.replace(secret, self.spec.marker.format(type=kind))
            out.append(line)
        return "\n".join(out)

    def __call__(self, text: str | None) -> str | None:
        return self.redact(text) if text else text
