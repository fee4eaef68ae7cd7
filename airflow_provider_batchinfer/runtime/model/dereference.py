"""Columns that hold file locations become the file's content before the model sees them.

``InputSpec.column_handling`` names columns of local paths or ``s3://`` URIs; each location is read
on the Ray side (where the data is) and turned into what the model expects: raw ``bytes``,
``base64`` text or a ``data_url`` (``data:image/png;base64,...``, what OpenAI-style chat
``image_url`` parts carry). Chat ``messages`` columns are walked the same way: an ``image_url`` or
``input_audio`` part that points at a stage file is replaced by its content.

A location is checked against the allowed roots *before* anything is opened: ``..`` segments,
relative paths, other schemes, other buckets, absolute paths elsewhere, NUL bytes and symlinks that
lead out of a root all fail that row with :class:`FileReferenceError`. The check resolves a local
path through its symlinks, and the *resolved* path is what is opened, one component at a time and
never through a symlink (``local_open.py``): a symlink swapped in between the check and the open
fails the row instead of being followed out of the root. ``http(s)`` URLs in messages are fetched
here too, only from the connection's ``allowed_url_hosts`` (``url_fetch.py``), and handed on as
``data:`` URLs, so Ray's multimodal stage never fetches an address itself. This is a boundary: an
input table written by someone else must not make a worker read ``/etc/shadow``, another team's
bucket or the cloud metadata endpoint. The functions here are pure apart from :func:`_read` and the
URL fetch, so every rule is tested without Ray.
"""

from __future__ import annotations

import base64
import json
import mimetypes
import os
import posixpath
import re
from typing import Any
from urllib.parse import urlsplit

from airflow_provider_batchinfer.runtime.model.local_open import NotFollowedError, NotRegularError, read_local
from airflow_provider_batchinfer.runtime.model.url_fetch import UrlReferenceError, fetch_url
from airflow_provider_batchinfer.store.stage import Stage

MESSAGES_DTYPE = "messages"  # signature dtype of a chat-messages model input
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HTTP = re.compile(r"^https?://", re.IGNORECASE)
# message parts whose URL vLLM would fetch or open, and the key that holds it
_URL_PARTS = {"image_url": "image_url", "input_image": "image_url", "audio_url": "audio_url", "video_url": "video_url"}
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"RIFF", "audio/wav"),
    (b"fLaC", "audio/flac"),
    (b"ID3", "audio/mpeg"),
    (b"OggS", "audio/ogg"),
)


class FileReferenceError(ValueError):
    """One row's file location cannot be used: outside the allowed roots, missing or unreadable.

    Raised per row (by :func:`read_location`), so a caller that dead-letters rows can catch it for
    that row alone; uncaught, it fails the job with the column and the location in the message."""


# --- where a location may point ------------------------------------------------------------------


def _split(location: str) -> tuple[str, str]:
    """(scheme, path): ``("file", "/abs/path")`` for local paths, ``("s3", "bucket/key")`` for S3."""
    match = _SCHEME.match(location)
    if not match:
        return "file", location
    scheme = match.group(1).lower()
    rest = location[match.end() :]
    if scheme == "file":
        return "file", rest
    if scheme in ("s3", "s3a"):
        return "s3", rest
    return scheme, rest


def normalize_roots(roots: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """Allowed roots as (scheme, normalized path); local roots resolved through symlinks once."""
    out = []
    for root in roots:
        scheme, path = _split(str(root))
        if scheme == "file":
            path = os.path.realpath(path)
        out.append((scheme, path.rstrip("/")))
    return out


def check_location(location: Any, roots: list[tuple[str, str]], column: str = "") -> str:
    """Where to open ``location`` when it lies under an allowed root; raise FileReferenceError otherwise.

    Never opens the file: only string checks and, for local paths, ``realpath`` (which follows
    symlinks with lstat/readlink), so a symlink inside a root that points elsewhere is refused too.
    A local location comes back *resolved* (``/root/link.png`` -> ``/root/real.png``): that path
    is what :func:`_read` opens, without following symlinks, so the file read is the file checked."""
    where = f"column {column!r}: " if column else ""
    allowed = ", ".join(f"{s}://{p}" if s != "file" else p for s, p in roots) or "none configured"
    if not isinstance(location, str) or not location.strip():
        raise FileReferenceError(f"{where}expected a file location (a local path or s3:// URI), got {location!r}")
    if "\x00" in location:
        raise FileReferenceError(f"{where}{location!r} contains a NUL byte; no file name does")
    try:
        location.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise FileReferenceError(f"{where}{location!r} cannot be encoded as a file name ({exc.reason})") from None
    scheme, path = _split(location)
    if scheme not in ("file", "s3"):
        raise FileReferenceError(f"{where}{location!r}: only local paths and s3:// URIs can be read, not {scheme}://")
    if ".." in path.replace("\\", "/").split("/"):
        raise FileReferenceError(
            f"{where}{location!r} contains '..'; file locations may not climb out of the allowed roots ({allowed})"
        )
    if scheme == "file":
        if not path.startswith("/"):
            raise FileReferenceError(
                f"{where}{location!r} is a relative path; write absolute paths or s3:// URIs in data_prep"
            )
        resolved = os.path.realpath(path)
    else:
        resolved = posixpath.normpath(path)
    for root_scheme, root in roots:
        if root_scheme == scheme and (resolved == root or resolved.startswith(root + "/")):
            return resolved if scheme == "file" else location
    moved = f" (it resolves to {resolved})" if scheme == "file" and resolved != posixpath.normpath(path) else ""
    raise FileReferenceError(
        f"{where}{location!r}{moved} is outside the allowed roots ({allowed}); move the file under one of them or "
        "add its root to the connection's allowed_roots extra"
    )


_FILESYSTEMS: dict[str, Any] = {}


def _read(location: str, storage_options: dict[str, Any] | None) -> bytes:
    """The one place that opens a referenced file (tests count its calls). One filesystem per
    scheme and options for the worker's life: an S3 client per row would cost more than the read."""
    scheme, path = _split(location)
    if scheme == "file":
        return read_local(path)
    key = json.dumps([scheme, storage_options or {}], sort_keys=True, default=str)
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs = _FILESYSTEMS[key] = Stage.open(location, storage_options).fs
    with fs.open_input_stream(path) as f:
        return f.read()


def read_location(
    location: Any, roots: list[tuple[str, str]], storage_options: dict[str, Any] | None, column: str = ""
) -> bytes:
    """Check, then read one location; a missing or unreadable file fails with its location."""
    checked = check_location(location, roots, column)
    where = f"column {column!r}: " if column else ""
    try:
        return _read(checked, storage_options)
    except FileNotFoundError:
        raise FileReferenceError(f"{where}file {location} does not exist; fix the location in data_prep") from None
    except NotFollowedError as exc:
        raise FileReferenceError(
            f"{where}{location!r}: a symbolic link appeared on {checked} after it was checked ({exc.strerror}); "
            "it is not followed"
        ) from None
    except (IsADirectoryError, NotRegularError) as exc:
        raise FileReferenceError(f"{where}cannot read {location}: {exc.strerror}") from None
    except OSError as exc:
        raise FileReferenceError(f"{where}cannot read {location}: {exc}") from None


# --- encodings -------------------------------------------------------------------------------------


def guess_mime_type(location: str, data: bytes) -> str:
    guessed, _ = mimetypes.guess_type(location)
    if guessed:
        return guessed
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    return "application/octet-stream"


def encode(data: bytes, encoding: str, location: str = "", mime_type: str | None = None) -> bytes | str:
    if encoding == "bytes":
        return data
    text = base64.b64encode(data).decode("ascii")
    if encoding == "base64":
        return text
    if encoding == "data_url":
        return f"data:{mime_type or guess_mime_type(location, data)};base64,{text}"
    raise ValueError(f"unknown file encoding {encoding!r}; use bytes, base64 or data_url")


def dereference_values(
    values: list[Any],
    rule: dict[str, Any],
    roots: list[tuple[str, str]],
    storage_options: dict[str, Any] | None,
    column: str,
) -> list[Any]:
    return [
        encode(read_location(v, roots, storage_options, column), rule["encoding"], v, rule.get("mime_type"))
        for v in values
    ]


# --- chat messages -----------------------------------------------------------------------------------


def _is_location(value: Any) -> bool:
    """A message part's payload names a stage file rather than carrying data: a URI (s3://, file://)
    or an absolute path with a file extension (base64 has no '.', so data is never mistaken)."""
    if not isinstance(value, str) or value.startswith(("data:", "http://", "https://")):
        return False
    if _SCHEME.match(value):
        return True
    return value.startswith("/") and "." in posixpath.basename(value)


def drop_nulls(value: Any) -> Any:
    """Arrow structs give every part every field (None where absent); OpenAI parts have only theirs."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def parse_messages(value: Any, column: str = "messages") -> list[dict[str, Any]]:
    """One row's messages, from a JSON string or an Arrow list of structs, as OpenAI-shaped dicts."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"column {column!r}: not valid JSON chat messages ({exc})") from None
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError(
            f"column {column!r}: chat messages must be a list of {{'role': ..., 'content': ...}}, got {value!r:.200}"
        )
    messages = drop_nulls(value)
    for m in messages:
        if "role" not in m or "content" not in m:
            raise ValueError(f"column {column!r}: every message needs 'role' and 'content', got {m!r:.200}")
    return messages


def _inline_url(
    url: Any, roots: list[tuple[str, str]], storage_options: dict[str, Any] | None, column: str, url_hosts: Any
) -> str:
    """A ``data:`` URL for one media part's URL: ``data:`` as it is, ``http(s)`` fetched under the
    allow-list, anything else read as a stage file under the roots. Nothing else is handed on:
    what vLLM would fetch or open itself is exactly what must not leave the box."""
    where = f"column {column!r}: " if column else ""
    if not isinstance(url, str) or not url.strip():
        raise FileReferenceError(f"{where}a media part without a URL: {url!r:.80}")
    if url[:5].lower() == "data:":
        return url
    if not _HTTP.match(url):
        return str(encode(read_location(url, roots, storage_options, column), "data_url", url))
    if "\x00" in url:
        raise FileReferenceError(f"{where}{url!r} contains a NUL byte")
    try:
        data, mime = fetch_url(url, tuple(url_hosts or ()))
    except UrlReferenceError as exc:
        raise FileReferenceError(f"{where}{url!r}: {exc}") from None
    if mime in (None, "application/octet-stream"):
        mime = guess_mime_type(urlsplit(url).path, data)
    return str(encode(data, "data_url", url, mime))


def _inline_part(
    part: dict[str, Any],
    roots: list[tuple[str, str]],
    storage_options: dict[str, Any] | None,
    column: str,
    url_hosts: Any,
) -> dict[str, Any]:
    part = dict(part)
    key = _URL_PARTS.get(str(part.get("type")))
    if key is not None:
        media = part.get(key)
        url = media.get("url") if isinstance(media, dict) else media
        inlined = _inline_url(url, roots, storage_options, column, url_hosts)
        if isinstance(media, dict):
            part[key] = {**media, "url": inlined}
        else:  # the Responses API's input_image holds the URL itself; the others hold {"url": ...}
            part[key] = inlined if part["type"] == "input_image" else {"url": inlined}
    elif part.get("type") == "input_audio":
        audio = dict(part.get("input_audio") or {})
        if _is_location(audio.get("data")):
            location = audio["data"]
            audio["data"] = encode(read_location(location, roots, storage_options, column), "base64")
            audio.setdefault("format", posixpath.splitext(location)[1].lstrip(".").lower() or "wav")
            part["input_audio"] = audio
    return part


def dereference_messages(
    messages: list[dict[str, Any]],
    roots: list[tuple[str, str]],
    storage_options: dict[str, Any] | None,
    column: str = "messages",
    url_hosts: tuple[str, ...] | list[str] = (),
) -> list[dict[str, Any]]:
    """Replace the URL of every ``image_url`` / ``input_image`` / ``audio_url`` / ``video_url`` part
    with a data URL (stage files read under ``roots``, ``http(s)`` fetched from ``url_hosts`` only)
    and stage files in ``input_audio`` parts with base64 data (and their format); text and data
    parts are left as they are. A reference that may not be read fails the row (FileReferenceError)."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = [_inline_part(p, roots, storage_options, column, url_hosts) for p in content]
        out.append({**message, "content": parts})
    return out


# --- one batch ----------------------------------------------------------------------------------------


def dereference_plan(
    input_spec_handling: dict[str, dict[str, Any]],
    sources: list[str],
    model_inputs: list[str],
    signature_inputs: dict[str, str],
    roots: list[str],
    storage_options: dict[str, Any] | None,
    url_hosts: tuple[str, ...] | list[str] = (),
) -> dict[str, Any] | None:
    """What :func:`dereference_inputs` does to each batch, keyed by model input name (the batch's
    column names at that point); ``None`` when no column needs it. ``url_hosts``: the connection's
    ``allowed_url_hosts``, the only hosts a message's ``http(s)`` URL is fetched from."""
    names = dict(zip(sources, model_inputs or sources, strict=False))
    unread = sorted(set(input_spec_handling) - set(names))
    if unread:
        from airflow_provider_batchinfer.store.inputs import InputError

        raise InputError(
            f"InputSpec.column_handling names {unread}, which the model does not read (its input columns: "
            f"{list(names)}); map the column to a model input with InputSpec.column_mapping"
        )
    handling = {names[src]: rule for src, rule in input_spec_handling.items()}
    messages = [
        m for m, dtype in signature_inputs.items() if str(dtype).lower() == MESSAGES_DTYPE and m in names.values()
    ]
    if not handling and not messages:
        return None
    return {
        "handling": handling,
        "messages": messages,
        "roots": list(roots),
        "storage_options": storage_options,
        "url_hosts": list(url_hosts),
    }


def dereference_inputs(table: Any, plan: dict[str, Any] | None) -> Any:
    """The batch with every handled column replaced by file contents (and message columns by JSON
    with their stage files inlined). Raises FileReferenceError for the first bad row."""
    if not plan:
        return table
    import pyarrow as pa

    roots = normalize_roots(plan["roots"])
    storage = plan.get("storage_options")
    for name, rule in plan["handling"].items():
        values = dereference_values(table.column(name).to_pylist(), rule, roots, storage, name)
        arr = pa.array(values, pa.binary() if rule["encoding"] == "bytes" else pa.string())
        table = table.set_column(table.column_names.index(name), name, arr)
    for name in plan["messages"]:
        rows = [
            json.dumps(dereference_messages(parse_messages(v, name), roots, storage, name, plan.get("url_hosts", ())))
            for v in table.column(name).to_pylist()
        ]
        table = table.set_column(table.column_names.index(name), name, pa.array(rows, pa.string()))
    return table
