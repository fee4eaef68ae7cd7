"""Local boundaries of the runtime, each attacked: a hard link under an allowed root is not read
(its other name may be anywhere); an IPv6 address that a gateway translates to an IPv4 one (NAT64,
6to4, Teredo, IPv4-mapped or -compatible) is not public; and a secret never reaches what the
runtime prints, whole or cut in half (scrubbed before any cut, across writes and flushes)."""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_batchinfer.runtime.model.dereference import FileReferenceError, normalize_roots, read_location
from airflow_provider_batchinfer.store.redact import MASK, scrub

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"


def _no_part_of(secret: str, text: str, shortest: int = 4) -> None:
    """No piece of ``secret`` of ``shortest`` characters or more is in ``text`` (a half, a prefix,
    a suffix), which an exact-match scrub would miss."""
    for size in range(shortest, len(secret) + 1):
        for start in range(len(secret) - size + 1):
            assert secret[start : start + size] not in text, f"{secret[start : start + size]!r} leaked in {text!r}"


# --- hard links ------------------------------------------------------------------------------------
def test_a_hard_link_inside_an_allowed_root_is_not_read(tmp_path):
    root, outside = tmp_path / "stage", tmp_path / "keys"
    root.mkdir()
    outside.mkdir()
    (outside / "id_rsa").write_bytes(b"PRIVATE KEY")
    os.link(outside / "id_rsa", root / "cat.png")  # a name inside the root for a file outside it
    roots = normalize_roots([str(root)])
    with pytest.raises(FileReferenceError) as info:
        read_location(str(root / "cat.png"), roots, None, column="image")
    message = str(info.value)
    assert f"column 'image': cannot read {root / 'cat.png'}: it has 2 hard links" in message
    assert "another of its names may lie outside the allowed roots" in message
    assert "put a copy of the file there (cp, not ln)" in message
    assert (outside / "id_rsa").read_bytes() == b"PRIVATE KEY"  # nothing touched
    # a copy has one name: read as any file is
    (root / "copy.png").write_bytes((outside / "id_rsa").read_bytes())
    assert read_location(str(root / "copy.png"), roots, None) == b"PRIVATE KEY"
    # two names both inside the root are refused too: the check cannot tell where another name lies
    (root / "a.png").write_bytes(b"inside")
    os.link(root / "a.png", root / "b.png")
    with pytest.raises(FileReferenceError, match=r"cannot read .*a\.png: it has 2 hard links"):
        read_location(str(root / "a.png"), roots, None)


# --- translated IPv6 addresses -------------------------------------------------------------------------
def _resolver(table: dict[str, list[str]]) -> Any:
    def resolve(host: str, port: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        return [(None, None, None, "", (address, port)) for address in table[host]]

    return resolve


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("64:ff9b::a00:1", "64:ff9b::a00:1 is a private address (NAT64 of 10.0.0.1)"),
        ("64:ff9b::a9fe:a9fe", "is a link-local address (NAT64 of 169.254.169.254)"),
        ("64:ff9b::808:808", "is a translated address (NAT64 of 8.8.8.8)"),
        ("64:ff9b:1::a00:1", "is a translated address (local-use NAT64)"),
        ("2002:a00:1::1", "2002:a00:1::1 is a private address (6to4 of 10.0.0.1)"),
        ("2002:a9fe:a9fe::1", "is a link-local address (6to4 of 169.254.169.254)"),
        ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "is a private address (Teredo of 65.54.227.120, 10.0.0.1)"),
        ("::a00:1", "is a private address (IPv4-compatible of 10.0.0.1)"),
        ("::ffff:8.8.8.8", "is a translated address (IPv4-mapped of 8.8.8.8)"),
        ("::ffff:127.0.0.1", "is a loopback address (IPv4-mapped of 127.0.0.1)"),
    ],
)
def test_an_address_a_gateway_translates_to_ipv4_is_not_public(address, message):
    from airflow_provider_batchinfer.runtime.model.url_fetch import UrlReferenceError, check_url

    dns = _resolver({"img.example.com": [address]})
    for allowed in (("*",), ("*.example.com",)):  # a pattern never reaches it
        with pytest.raises(UrlReferenceError, match=re.escape(message)) as info:
            check_url("http://img.example.com/a.png", allowed, resolve=dns)
        assert "names the host or its network" in str(info.value)
    # naming the host, or the IPv6 network it lies in, reaches it (an IPv6-only cluster behind NAT64)
    assert check_url("http://img.example.com/a.png", ("img.example.com",), resolve=dns).addresses == (address,)
    network = {"64": "64:ff9b::/32", "20": "2000::/4", "::": "::/64"}[address[:2]]
    assert check_url("http://img.example.com/a.png", ("*", network), resolve=dns).addresses == (address,)


def test_a_public_ipv6_address_is_still_fetched_under_a_pattern():
    from airflow_provider_batchinfer.runtime.model.url_fetch import check_url

    dns = _resolver({"cdn.example.com": ["2606:4700::6810:84e5"]})
    assert check_url("https://cdn.example.com/a.png", ("*",), resolve=dns).addresses == ("2606:4700::6810:84e5",)


# --- scrubbing before a cut ----------------------------------------------------------------------------
def test_a_message_cut_through_a_secret_shows_none_of_it(monkeypatch):
    """A database error that echoes the server's URL with its password, cut at 200 characters: the
    password is scrubbed first, so the cut never leaves a piece of it."""
    from airflow_provider_batchinfer.store.redact import clip, mask_cut

    password = "Tr0ub4dor-and-3-horses-9f2c1e"
    monkeypatch.setenv("BATCHINFER_SQL_URL", f"postgresql://etl:{password}@db.internal:5432/lake")
    text = f"OperationalError: {'x' * 140} while connecting to postgresql://etl:{password}@db.internal:5432"
    assert text.index(password) == 196  # a cut at 200 would keep its first 4 characters
    cut = clip(text, 200)
    assert cut.startswith("OperationalError: xxx") and cut.endswith(f"etl:{MASK}@")
    _no_part_of(password, cut)
    # the whole URL is a secret too: scrubbed whole before the cut
    assert clip(f"failed: postgresql://etl:{password}@db.internal:5432/lake", 200) == f"failed: {MASK}"
    # a text cut before it got here (by a library): the tail that begins a secret is masked
    assert mask_cut(f"error near {SECRET[:11]}", [SECRET]) == f"error near {MASK}"
    assert mask_cut("nothing secret", [SECRET]) == "nothing secret"
    assert clip("a long message", 6, [SECRET]) == "a long"


def test_a_dead_lettered_rows_error_holds_no_half_secret(monkeypatch):
    from airflow_provider_batchinfer.runtime.errors import MAX_MESSAGE_CHARS, error_message

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    # "ValueError: " is 12 characters: the 2,000-character cut falls 10 characters into the secret
    message = error_message(ValueError("y" * (MAX_MESSAGE_CHARS - 12 - 10) + SECRET))
    assert message.startswith("ValueError: yyy") and message.endswith(MASK)
    _no_part_of(SECRET, message)


def test_a_secret_in_json_reaches_the_scrub_escaped():
    quoted = 'pa"ss\\word-123'
    line = '{"error": "login failed for pa\\"ss\\\\word-123"}'
    assert quoted not in line and MASK in scrub(line, [quoted])


# --- everything printed is scrubbed --------------------------------------------------------------------
def test_a_secret_written_in_pieces_with_flushes_between_never_shows():
    from airflow_provider_batchinfer.store.redact import ScrubbingStream

    out = io.StringIO()
    stream = ScrubbingStream(out, [SECRET])
    stream.write(f"progress: key {SECRET[:12]}")
    stream.flush()  # a partial line goes out, less the tail that may still become the secret
    assert out.getvalue() == "progress: key "
    stream.write(SECRET[12:30])
    stream.flush()
    stream.write(f"{SECRET[30:]} done\nnext ")
    stream.flush()
    assert out.getvalue() == f"progress: key {MASK} done\nnext "
    stream.write(SECRET[:20])  # the job ends mid-secret: what is left is masked, never written
    stream.close()
    assert out.getvalue() == f"progress: key {MASK} done\nnext {MASK}"
    _no_part_of(SECRET, out.getvalue())
    assert not out.closed  # the real stream stays open


def test_bytes_and_concurrent_writers_are_scrubbed_too():
    from airflow_provider_batchinfer.store.redact import ScrubbingStream

    out = io.StringIO()
    stream = ScrubbingStream(out, [SECRET])
    encoded = f"raw é {SECRET}\n".encode()
    stream.buffer.write(encoded[:5])  # "é" is two bytes: split across two writes
    stream.buffer.write(encoded[5:])

    def worker(n: int) -> None:
        for _ in range(50):
            print(f"worker {n}:", SECRET[:15], end="", file=stream)
            print(SECRET[15:], file=stream)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stream.close()
    text = out.getvalue()
    assert text.count("\n") == 201 and text.startswith(f"raw é {MASK}\n")
    _no_part_of(SECRET, text)


def test_scrubbed_output_covers_print_stderr_and_log_handlers_made_before(capsys):
    from airflow_provider_batchinfer.store import redact

    logger = logging.getLogger("test_local_boundaries.early")
    handler = logging.StreamHandler(sys.stderr)  # made before: holds the original stream
    logger.addHandler(handler)
    logger.propagate = False
    last = logging.getLogger("test_local_boundaries.last_resort")  # its handler reads sys.stderr anew
    last.addHandler(logging.lastResort)  # type: ignore[arg-type]
    last.propagate = False
    original_out, original_err = sys.stdout, sys.stderr
    try:
        with redact.scrubbed_output([SECRET]):
            print("key", SECRET)
            sys.stdout.write(f"cut {SECRET[:8]}")
            sys.stdout.flush()
            sys.stdout.write(f"{SECRET[8:]}\n")
            print(f"err {SECRET}", file=sys.stderr)
            logger.warning("logged %s", SECRET)
            last.warning("last resort %s", SECRET)
            assert SECRET in redact.known_secrets()  # clip() scrubs it from then on
        assert (sys.stdout, sys.stderr) == (original_out, original_err) and handler.stream is original_err
        assert not handler.filters
    finally:
        logger.removeHandler(handler)
        last.removeHandler(logging.lastResort)  # type: ignore[arg-type]
    captured = capsys.readouterr()
    assert captured.out == f"key {MASK}\ncut {MASK}\n"
    assert captured.err == f"err {MASK}\nlogged {MASK}\nlast resort {MASK}\n"


def test_scrubbing_stream_delegates_what_callers_ask_a_stream(tmp_path: Path):
    from airflow_provider_batchinfer.store.redact import ScrubbingStream

    with open(tmp_path / "out.txt", "w", encoding="utf-8") as real:
        stream = ScrubbingStream(real, [SECRET])
        assert stream.fileno() == real.fileno() and stream.encoding == "utf-8" and not stream.isatty()
        assert stream.name == real.name and stream.writable()
        stream.write(f"{SECRET}\n")
        stream.close()
    assert (tmp_path / "out.txt").read_text() == f"{MASK}\n"
