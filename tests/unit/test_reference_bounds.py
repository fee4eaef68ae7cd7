"""File and URL references stay inside their boundary: a local file is opened by the path that was
checked, never through a symlink that appears later; an ``http(s)`` URL is fetched only from a host
the connection allows and never from a private, loopback or link-local address it does not name;
and every bad reference (a NUL byte included) fails its own row with ``FileReferenceError``."""

from __future__ import annotations

import base64
import http.server
import io
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_provider_batchinfer.runtime.model import dereference
from airflow_provider_batchinfer.runtime.model.dereference import (
    FileReferenceError,
    check_location,
    dereference_messages,
    normalize_roots,
    read_location,
)

METADATA_URL = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (2, 2), "red").save(buf, format="PNG")
    return buf.getvalue()


def _image_message(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


@pytest.fixture
def boxed(tmp_path: Path) -> dict[str, Path]:
    """A root with ``docs/ok.png`` inside and, outside it, a directory holding a secret of the same name."""
    root = tmp_path / "stage"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "ok.png").write_bytes(b"inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "ok.png").write_bytes(b"SECRET")
    return {"root": root, "outside": outside}


def _swap_after_check(monkeypatch: pytest.MonkeyPatch, swap: Any) -> list[str]:
    """Run ``swap`` right after every ``check_location`` passes: the window an attacker races for."""
    real_check = dereference.check_location
    checked: list[str] = []

    def check_then_swap(location: Any, roots: Any, column: str = "") -> str:
        result = real_check(location, roots, column)
        checked.append(location)
        swap()
        return result

    monkeypatch.setattr(dereference, "check_location", check_then_swap)
    return checked


# --- a symlink swapped in between the check and the open -------------------------------------------------


def _swap_dir(box: dict[str, Path]) -> None:
    docs = box["root"] / "docs"
    if not docs.is_symlink():
        shutil.rmtree(docs)
        docs.symlink_to(box["outside"], target_is_directory=True)


def _swap_file(box: dict[str, Path]) -> None:
    target = box["root"] / "docs" / "ok.png"
    if not target.is_symlink():
        target.unlink()
        target.symlink_to(box["outside"] / "ok.png")


@pytest.mark.parametrize("swap", [_swap_dir, _swap_file], ids=["directory", "file"])
def test_a_symlink_swapped_in_after_the_check_is_not_followed(boxed, monkeypatch, swap):
    roots = normalize_roots([str(boxed["root"])])
    location = str(boxed["root"] / "docs" / "ok.png")
    assert read_location(location, roots, None, "path") == b"inside"
    checked = _swap_after_check(monkeypatch, lambda: swap(boxed))
    with pytest.raises(FileReferenceError, match=r"column 'path': .*symbolic link") as info:
        read_location(location, roots, None, "path")
    assert checked == [location] and "SECRET" not in str(info.value)


def test_a_symlink_inside_the_root_that_stays_inside_is_still_read(boxed):
    """Symlinks are resolved at the check; the resolved path is what is opened."""
    (boxed["root"] / "alias.png").symlink_to(boxed["root"] / "docs" / "ok.png")
    (boxed["root"] / "docs-link").symlink_to(boxed["root"] / "docs", target_is_directory=True)
    roots = normalize_roots([str(boxed["root"])])
    assert read_location(str(boxed["root"] / "alias.png"), roots, None) == b"inside"
    assert read_location(str(boxed["root"] / "docs-link" / "ok.png"), roots, None) == b"inside"
    assert check_location(str(boxed["root"] / "alias.png"), roots) == str(boxed["root"] / "docs" / "ok.png")


def test_special_files_and_directories_inside_the_root_are_refused(boxed):
    roots = normalize_roots([str(boxed["root"])])
    os.mkfifo(boxed["root"] / "pipe.png")  # opening a FIFO for reading would block the worker
    with pytest.raises(FileReferenceError, match=r"pipe.png: not a regular file"):
        read_location(str(boxed["root"] / "pipe.png"), roots, None)
    with pytest.raises(FileReferenceError, match=r"cannot read .*/docs: is a directory"):
        read_location(str(boxed["root"] / "docs"), roots, None)
    with pytest.raises(FileReferenceError, match=r"file .*/docs/nope.png does not exist"):
        read_location(str(boxed["root"] / "docs" / "nope.png"), roots, None)


# --- NUL bytes and other unusable strings -------------------------------------------------------------


def test_a_nul_byte_is_a_file_reference_error_not_a_value_error(boxed):
    roots = normalize_roots([str(boxed["root"]), "s3://bucket/stage"])
    for location in (
        f"{boxed['root']}/docs/ok.png\x00.txt",
        f"file://{boxed['root']}/a\x00b.png",
        "s3://bucket/stage/a\x00.png",
        f"{boxed['root']}/docs/\udcff\ud800.png",  # not encodable for the file system
    ):
        with pytest.raises(FileReferenceError, match=r"column 'path': .*(NUL byte|cannot be encoded)"):
            read_location(location, roots, None, "path")
    with pytest.raises(FileReferenceError, match=r"column 'messages': .*NUL byte"):
        dereference_messages(_image_message(f"{boxed['root']}/docs/x\x00.png"), roots, None)


# --- http(s) URLs in chat messages ----------------------------------------------------------------------


def test_the_metadata_endpoint_is_never_handed_to_the_image_stage(boxed):
    """By default no URL is fetched: the row fails with what to set, and nothing reaches Ray's stage."""
    roots = normalize_roots([str(boxed["root"])])
    for url in (METADATA_URL, "https://cdn.example.com/x.png", "HTTP://169.254.169.254/"):
        with pytest.raises(FileReferenceError, match=r"column 'messages': .*allowed_url_hosts") as info:
            dereference_messages(_image_message(url), roots, None)
        assert url in str(info.value)
    for part in (
        {"type": "audio_url", "audio_url": {"url": METADATA_URL}},
        {"type": "video_url", "video_url": {"url": METADATA_URL}},
        {"type": "input_image", "image_url": METADATA_URL},
    ):
        with pytest.raises(FileReferenceError, match="allowed_url_hosts"):
            dereference_messages([{"role": "user", "content": [part]}], roots, None)


def test_non_url_image_references_are_checked_as_files(boxed):
    """A part vLLM would open as a local path (no extension, relative) is checked, not passed on."""
    roots = normalize_roots([str(boxed["root"])])
    for url, message in (
        ("/etc/shadow", "is outside the allowed roots"),
        ("docs/ok.png", "is a relative path"),
        ("ftp://example.com/x.png", "only local paths and s3:// URIs"),
    ):
        with pytest.raises(FileReferenceError, match=message):
            dereference_messages(_image_message(url), roots, None)


def _resolver(table: dict[str, list[str]]) -> Any:
    def resolve(host: str, port: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        return [(None, None, None, "", (address, port)) for address in table[host]]

    return resolve


def test_allowed_hosts_and_every_resolved_address_are_checked():
    from airflow_provider_batchinfer.runtime.model.url_fetch import UrlReferenceError, check_url

    dns = _resolver(
        {
            "cdn.example.com": ["93.184.216.34"],
            "rebound.example.com": ["93.184.216.34", "169.254.169.254"],
            "internal.example.com": ["10.0.5.7"],
            "mapped.example.com": ["::ffff:169.254.169.254"],
            "minio.corp": ["10.0.5.7"],
            "169.254.169.254": ["169.254.169.254"],
            "127.0.0.1": ["127.0.0.1"],
            "localhost": ["127.0.0.1", "::1"],
        }
    )
    ok = check_url("https://cdn.example.com/a.png", ("*.example.com",), resolve=dns)
    assert ok.host == "cdn.example.com" and ok.port == 443 and ok.addresses == ("93.184.216.34",)
    assert check_url("http://minio.corp:9000/b/x.png", ("minio.corp",), resolve=dns).addresses == ("10.0.5.7",)
    assert check_url("http://internal.example.com/x", ("*.example.com", "10.0.0.0/8"), resolve=dns).port == 80
    assert check_url(METADATA_URL, ("169.254.169.254",), resolve=dns).addresses == ("169.254.169.254",)
    refused = {
        (METADATA_URL, ()): "allowed_url_hosts is empty",
        (METADATA_URL, ("*",)): "169.254.169.254 is a link-local address",
        (METADATA_URL, ("cdn.example.com",)): "host '169.254.169.254' is not in the connection's allowed_url_hosts",
        ("http://rebound.example.com/", ("*.example.com",)): "169.254.169.254 is a link-local address",
        ("http://mapped.example.com/", ("*",)): "is a link-local address",
        ("http://internal.example.com/", ("*.example.com",)): "10.0.5.7 is a private address",
        ("http://localhost:8080/", ("*",)): "127.0.0.1 is a loopback address",
        ("http://127.0.0.1/", ("localhost",)): "host '127.0.0.1' is not in",
        ("http://user:pw@cdn.example.com/", ("*",)): "credentials in a URL",
        ("http:///nohost", ("*",)): "has no host",
        ("http://cdn.example.com:99999/", ("*",)): "bad port",
    }
    for (url, hosts), message in refused.items():
        with pytest.raises(UrlReferenceError, match=message):
            check_url(url, hosts, resolve=dns)


@pytest.fixture
def image_server() -> Iterator[dict[str, Any]]:
    """A real HTTP server on 127.0.0.1 serving a PNG, a redirect and a large body; it records each path."""
    png = _png()
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            if self.path == "/img.png":
                body, ctype = png, "image/png"
            elif self.path == "/big":
                body, ctype = b"x" * 4096, "application/octet-stream"
            elif self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/img.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"base": f"http://127.0.0.1:{server.server_port}", "seen": seen, "png": png}
    finally:
        server.shutdown()
        server.server_close()


def test_an_allowed_host_is_fetched_by_the_runtime_and_handed_on_as_a_data_url(boxed, image_server, monkeypatch):
    from airflow_provider_batchinfer.runtime.model import url_fetch

    roots = normalize_roots([str(boxed["root"])])
    base, seen = image_server["base"], image_server["seen"]
    out = dereference_messages(_image_message(f"{base}/img.png"), roots, None, url_hosts=("127.0.0.1",))
    encoded = base64.b64encode(image_server["png"]).decode()
    assert out[0]["content"][1]["image_url"] == {"url": f"data:image/png;base64,{encoded}"}
    assert seen == ["/img.png"]
    for url, hosts, message in (
        (f"{base}/img.png", ("*",), "127.0.0.1 is a loopback address"),  # a wildcard never allows loopback
        (f"{base}/img.png", (), "allowed_url_hosts is empty"),
        (f"{base}/redirect", ("127.0.0.1",), "answered 302; redirects are not followed"),
        (f"{base}/missing.png", ("127.0.0.1",), "answered 404"),
    ):
        with pytest.raises(FileReferenceError, match=message):
            dereference_messages(_image_message(url), roots, None, url_hosts=hosts)
    assert seen == ["/img.png", "/redirect", "/missing.png"]  # the redirect's target was never asked for
    monkeypatch.setattr(url_fetch, "MAX_URL_BYTES", 1024)
    with pytest.raises(FileReferenceError, match="more than 1024 bytes"):
        dereference_messages(_image_message(f"{base}/big"), roots, None, url_hosts=("127.0.0.1",))


def test_allowed_url_hosts_travel_from_the_connection_through_the_job_file():
    from airflow_provider_batchinfer.contract.job_file import JobFile
    from airflow_provider_batchinfer.contract.url_hosts import parse_url_hosts
    from airflow_provider_batchinfer.hooks.connection_fields import CONN_FIELDS
    from airflow_provider_batchinfer.hooks.service_config import ServiceConfig
    from tests.models import job_file

    assert "allowed_url_hosts" in CONN_FIELDS

    def conn(**extra: Any) -> Any:
        from airflow.sdk import Connection

        return Connection(conn_id="bi", conn_type="batchinfer", extra=json.dumps(extra))

    config = ServiceConfig.from_connection(
        conn(allowed_url_hosts="cdn.example.com, *.images.example.com ,10.0.0.0/8"), "bi"
    )
    assert config.allowed_url_hosts == ("cdn.example.com", "*.images.example.com", "10.0.0.0/8")
    assert config.to_dict()["allowed_url_hosts"] == ["cdn.example.com", "*.images.example.com", "10.0.0.0/8"]
    assert ServiceConfig.from_connection(None, "batchinfer_default").allowed_url_hosts == ()
    for value, message in (
        (["https://cdn.example.com/"], "write host names"),
        (["cdn.example.com:443"], "write host names"),
        (["*cdn.example.com"], "'\\*' alone or '\\*.' before a domain"),
        (["10.0.0.0/33"], "not a valid"),
        ("[1, 2", "JSON list"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_url_hosts(value, "connection 'bi'", ValueError)
    with pytest.raises(ValueError, match=r"connection 'bi': allowed_url_hosts entry 'http://x/'"):
        ServiceConfig.from_connection(conn(allowed_url_hosts=["http://x/"]), "bi")

    spec = job_file("/tmp/run", _model_version(), "/tmp/reg", ["/tmp/in"], job_id="j", attempt="t01abc")
    assert JobFile.from_json(spec.to_json()).allowed_url_hosts == ()
    with_hosts = json.loads(spec.to_json()) | {"allowed_url_hosts": ["cdn.example.com", "*"]}
    assert JobFile.from_dict(with_hosts).allowed_url_hosts == ("cdn.example.com", "*")
    from airflow_provider_batchinfer.contract.layout import ContractError

    with pytest.raises(ContractError, match="allowed_url_hosts entry 'http://x/'"):
        JobFile.from_dict(with_hosts | {"allowed_url_hosts": ["http://x/"]})


def _model_version() -> Any:
    from airflow_provider_batchinfer.registry import ModelVersion

    return ModelVersion(name="m", version="v1", flavor="python", uri="/tmp/reg/m/v1", sha256="0" * 64, signature={})


# --- the runtime: each bad reference is one dead-lettered row ------------------------------------------


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    from airflow_provider_batchinfer.registry.demo_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("chat") / "model")


def test_bad_references_are_dead_lettered_rows_and_the_rest_are_scored(registry, chat_model_dir, boxed, monkeypatch):
    """The replica (what each Ray actor runs) with ``on_error="dead_letter"``: the metadata URL, a
    NUL byte and a symlink swapped in after the check each fail their own row with
    FileReferenceError; the text rows are generated, and the row counts add up."""
    from airflow_provider_batchinfer.contract.specs import InputSpec
    from airflow_provider_batchinfer.runtime.errors import split_errors
    from airflow_provider_batchinfer.runtime.model.replica import ModelReplica
    from airflow_provider_batchinfer.runtime.planning.pipeline import plan_columns

    mv = registry.log_model("chat", "v1", "text_generation", str(chat_model_dir))
    swapped = str(boxed["root"] / "docs" / "ok.png")
    text = [{"role": "user", "content": "summarize : the billing page fails"}]
    rows = [
        text,
        _image_message(METADATA_URL),
        _image_message(f"{boxed['root']}/docs/a\x00.png"),
        _image_message(swapped),
        text,
    ]
    batch = pa.table({"id": list(range(len(rows))), "messages": [json.dumps(m) for m in rows]})
    spec = InputSpec(id_column="id", params={"temperature": 0, "max_tokens": 3})
    plan = plan_columns(batch.schema, mv.signature, spec, "in.parquet")
    plan["dereference"] = dereference.dereference_plan(
        {}, plan["sources"], plan["model_inputs"], mv.signature["inputs"], [str(boxed["root"])], None
    )

    def swap_back_and_forth() -> None:  # the real file at every check, a symlink at every open
        _swap_dir(boxed)

    real_check = dereference.check_location

    def check(location: Any, roots: Any, column: str = "") -> str:
        docs = boxed["root"] / "docs"
        if docs.is_symlink():
            docs.unlink()
            docs.mkdir()
            (docs / "ok.png").write_bytes(b"inside")
        result = real_check(location, roots, column)
        if location == swapped:
            swap_back_and_forth()
        return result

    monkeypatch.setattr(dereference, "check_location", check)
    replica = ModelReplica(
        str(registry.local_copy("chat", "v1")),
        mv.sha256,
        plan,
        dict(spec.params),
        "cpu",
        1,
        policy={"on_error": "dead_letter", "keep_columns": ["id"], "id_column": "id"},
    )
    good, bad = split_errors(replica(batch), ["id"])
    assert good.column("id").to_pylist() == [0, 4]
    assert all(c[0]["message"]["content"] for c in good.column("choices").to_pylist())
    errors = dict(zip(bad.column("id").to_pylist(), bad.column("error").to_pylist(), strict=True))
    assert sorted(errors) == [1, 2, 3] and good.num_rows + bad.num_rows == batch.num_rows
    assert all(e.startswith("FileReferenceError: column 'messages': ") for e in errors.values()), errors
    assert "allowed_url_hosts" in errors[1] and "NUL byte" in errors[2] and "symbolic link" in errors[3]
