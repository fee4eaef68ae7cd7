"""Keeping secret values out of text that is logged, listed or recorded.

Two tools, both by value rather than by name: :func:`scrub` replaces every known secret value in a
text (an error message, a driver log line) with ``***``, whatever the text around it looks like; and
:func:`redact_uri` takes the credentials out of a URI (userinfo, and query parameters that carry a
password, token, key or signature), so a URI can be recorded in a job file or a manifest.

Shared by both sides: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit

MASK = "***"
#: shorter values are not scrubbed: "1" or "us" would mangle every line without hiding anything
MIN_SECRET_LEN = 6
#: query parameters that carry a credential (matched within the lower-cased name)
_SECRET_PARAM = re.compile(r"pass|pwd|token|secret|key|credential|signature|sig$|auth|session")
#: environment variables whose values are credentials, beside ``PYICEBERG_CATALOG__*``
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of a known secret value replaced by ``***`` (longest first, so
    a secret that contains another is masked whole)."""
    for value in sorted({s for s in secrets if s and len(s) >= MIN_SECRET_LEN}, key=len, reverse=True):
        text = text.replace(value, MASK)
    return text


class _ScrubFilter(logging.Filter):
    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        clean = scrub(text, self.secrets)
        if clean != text:
            record.msg, record.args = clean, None
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, self.secrets)
        return True


def install_log_scrubber(secrets: Iterable[str]) -> None:
    """Scrub ``secrets`` from every record the root logger's handlers write (messages and
    tracebacks): a process that holds credentials logs none of them."""
    values = [s for s in secrets if s]
    if not values:
        return
    for handler in logging.getLogger().handlers:
        handler.addFilter(_ScrubFilter(values))


def secret_values(environ: Mapping[str, str]) -> list[str]:
    """The credential values an environment holds: ``AWS_*`` keys, every Iceberg catalog property
    delivered as ``PYICEBERG_CATALOG__*`` (only secret ones are delivered that way) and a SQL
    input's database URL (``BATCHINFER_SQL_URL``), each URI with its password or token."""
    from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV

    found = [environ[n] for n in environ if n in SECRET_ENV and environ[n]]
    for name, value in environ.items():
        if (name.upper().startswith("PYICEBERG_CATALOG__") or name == SQL_URL_ENV) and value:
            found.extend([value, *uri_secrets(value)])
    return found


def uri_secrets(uri: str) -> list[str]:
    """The credential parts of a URI (its userinfo's password, or a userinfo that is a bare token,
    and the values of secret query parameters), to scrub from text that may echo the URI."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return []
    found = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        found.append(userinfo.partition(":")[2] if ":" in userinfo else userinfo)
    found.extend(v for k, v in parse_qsl(parts.query, keep_blank_values=True) if _SECRET_PARAM.search(k.lower()))
    return [f for f in found if f]


def redact_uri(uri: str) -> str:
    """``uri`` without credentials: ``scheme://user:***@host`` for a password, ``scheme://***@host``
    for a userinfo that is a bare token, and ``***`` for each secret query parameter. Everything else
    is kept as written (``sqlite:////abs/path`` too)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return MASK
    out = uri
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:{MASK}@{host}" if ":" in userinfo else f"{MASK}@{host}"
        out = out.replace(f"//{parts.netloc}", f"//{netloc}", 1)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k.lower()) for k, _ in pairs):
            query = urlencode([(k, MASK if _SECRET_PARAM.search(k.lower()) else v) for k, v in pairs], safe="*")
            head, _, rest = out.partition("?")
            fragment = rest.partition("#")[2]
            out = f"{head}?{query}" + (f"#{fragment}" if fragment else "")
    return out
