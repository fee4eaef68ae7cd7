"""Keeping secret values out of text that is logged, listed or recorded.

Two tools, both by value rather than by name: :func:`scrub` replaces every known secret value in a
text (an error message, a driver log line) with ``***``, whatever the text around it looks like; and
:func:`redact_uri` takes the credentials out of a URI (userinfo, and query parameters that carry a
password, token, key or signature), so a URI can be recorded in a job file or a manifest.

A text cut short must be scrubbed before the cut: exact matching cannot find half a secret. So
:func:`clip` scrubs, then cuts, and masks a tail that begins a secret. A process that holds
credentials (the runtime) scrubs everything it prints, not only its log records:
:func:`scrubbed_output` puts :class:`ScrubbingStream` in front of ``sys.stdout`` and ``sys.stderr``
(``print``, Ray's forwarded worker lines, log handlers), holding back a partial line's tail for as
long as it could still grow into a secret.

Shared by both sides: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any
from urllib.parse import parse_qsl, urlencode, urlsplit

MASK = "***"
#: shorter values are not scrubbed: "1" or "us" would mangle every line without hiding anything
MIN_SECRET_LEN = 6
#: query parameters that carry a credential (matched within the lower-cased name)
_SECRET_PARAM = re.compile(r"pass|pwd|token|secret|key|credential|signature|sig$|auth|session")
#: environment variables whose values are credentials, beside ``PYICEBERG_CATALOG__*``
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _forms(secrets: Iterable[str]) -> list[str]:
    """The secrets long enough to scrub, each also as JSON writes it inside a string (a secret with a
    quote or a backslash in it reaches a runtime line escaped), longest first."""
    values = {s for s in secrets if s and len(s) >= MIN_SECRET_LEN}
    values |= {json.dumps(s)[1:-1] for s in values}
    return sorted(values, key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of a known secret value replaced by ``***`` (longest first, so
    a secret that contains another is masked whole)."""
    for value in _forms(secrets):
        text = text.replace(value, MASK)
    return text


def _open_tail(text: str, forms: list[str]) -> int:
    """The length of the longest end of ``text`` that is the start of a secret (0 for none)."""
    longest = 0
    for value in forms:
        for size in range(min(len(value) - 1, len(text)), longest, -1):
            if text.endswith(value[:size]):
                longest = size
                break
    return longest


def mask_cut(text: str, secrets: Iterable[str]) -> str:
    """``text``, whose end is a cut, with an end that begins a secret masked as well: a secret cut
    in half before it was scrubbed shows none of its half."""
    held = _open_tail(text, _forms(secrets))
    return f"{text[:-held]}{MASK}" if held else text


_KNOWN: set[str] = set()


def remember(secrets: Iterable[str]) -> None:
    """Add ``secrets`` to the values this process scrubs from every text it clips (:func:`clip`)."""
    _KNOWN.update(s for s in secrets if s)


def known_secrets() -> list[str]:
    """Every secret value this process knows: remembered ones and those its environment holds."""
    return [*_KNOWN, *secret_values(os.environ)]


def clip(text: str, limit: int, secrets: Iterable[str] = ()) -> str:
    """``text`` scrubbed of ``secrets`` and of :func:`known_secrets`, then cut to ``limit``
    characters: scrubbing first means a cut never leaves part of a secret that a later, exact
    scrub would miss; a tail that begins a secret (one already cut before it got here) is masked."""
    values = [*secrets, *known_secrets()]
    clean = scrub(text, values)
    return clean if len(clean) <= limit else mask_cut(clean[:limit], values)


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


#: a partial line longer than this is written out (less a tail that may begin a secret) without a flush
_MAX_PENDING = 64 * 1024


class ScrubbingStream(io.TextIOBase):
    """A text stream that writes to ``stream`` with ``secrets`` scrubbed. Whole lines go out at
    once; a partial line goes out on ``flush`` except for a tail that could still grow into a
    secret, which waits for the next write (or is masked by ``close``). Writes from several
    threads (Ray prints its workers' lines from one of its own) are serialized."""

    def __init__(self, stream: IO[str], secrets: Iterable[str]) -> None:
        super().__init__()
        self.stream = stream
        self._forms = _forms(secrets)
        self._pending = ""
        self._lock = threading.RLock()
        self._bytes: _ScrubbingBytes | None = None

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            end = self._pending.rfind("\n") + 1
            if end:
                lines, self._pending = self._pending[:end], self._pending[end:]
                self.stream.write(scrub(lines, self._forms))
            if len(self._pending) > _MAX_PENDING:
                self._write_partial()
        return len(text)

    def _write_partial(self) -> None:
        clean = scrub(self._pending, self._forms)
        held = _open_tail(clean, self._forms)
        self._pending = clean[len(clean) - held :] if held else ""
        if len(clean) > held:
            self.stream.write(clean[: len(clean) - held])

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._write_partial()
            self.stream.flush()

    def close(self) -> None:
        """Write out what is left (a tail that begins a secret masked); ``stream`` stays open."""
        with self._lock:
            if not self.closed and self._pending:
                self.stream.write(mask_cut(scrub(self._pending, self._forms), self._forms))
                self._pending = ""
            with contextlib.suppress(ValueError, OSError):
                self.stream.flush()
        super().close()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.stream, "errors", None)

    @property
    def buffer(self) -> _ScrubbingBytes:
        """Bytes written here are decoded and scrubbed like text."""
        if self._bytes is None:
            self._bytes = _ScrubbingBytes(self)
        return self._bytes

    def __getattr__(self, name: str) -> Any:  # line_buffering, name, mode, reconfigure...
        return getattr(self.stream, name)


class _ScrubbingBytes(io.RawIOBase):
    def __init__(self, text: ScrubbingStream) -> None:
        super().__init__()
        self.text = text
        self._decoder = codecs.getincrementaldecoder(text.encoding)("replace")  # a character split across writes

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raw = bytes(data)
        self.text.write(self._decoder.decode(raw))
        return len(raw)

    def flush(self) -> None:
        self.text.flush()


@contextlib.contextmanager
def scrubbed_output(secrets: Iterable[str]) -> Iterator[None]:
    """While inside, everything this process writes through ``sys.stdout`` and ``sys.stderr`` and
    every log handler's record is scrubbed of ``secrets`` (which :func:`clip` also scrubs from then
    on). Log handlers made earlier that write to the original streams are pointed at the scrubbing
    ones for the duration. Both streams are restored, and what is pending written, on the way out."""
    values = [s for s in secrets if s]
    remember(values)
    if not values:
        yield
        return
    originals = (sys.stdout, sys.stderr)
    wrapped = {id(s): ScrubbingStream(s, values) for s in originals if s is not None}
    log_filter = _ScrubFilter(values)
    handlers = _all_handlers()
    moved: list[tuple[logging.StreamHandler[Any], Any]] = []
    for handler in handlers:
        handler.addFilter(log_filter)
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.StreamHandler) and id(stream) in wrapped and stream in originals:
            try:
                handler.setStream(wrapped[id(stream)])
            except AttributeError:  # a stream that is a property (logging's last resort reads sys.stderr anew)
                continue
            moved.append((handler, stream))
    if sys.stdout is not None:
        sys.stdout = wrapped[id(sys.stdout)]
    if sys.stderr is not None:
        sys.stderr = wrapped[id(sys.stderr)]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = originals
        for handler, stream in moved:
            handler.setStream(stream)
        for handler in handlers:
            handler.removeFilter(log_filter)
        for stream in wrapped.values():
            stream.close()


def _all_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    found: dict[int, logging.Handler] = {}
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            found.setdefault(id(handler), handler)
    return list(found.values())


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
