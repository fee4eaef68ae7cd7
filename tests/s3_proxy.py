"""A fault-injecting HTTP proxy in front of ``moto_server``: S3 failures on demand, on real sockets.

moto keeps its objects in memory, so killing moto itself would also forget what was written before
the crash, which no real store does. This proxy is what the clients (the operator, the runtime, its Ray
workers) talk to instead; it forwards every request to moto unchanged and, per rule, answers
some of them itself:

- ``{"match": "PUT .*/part-", "status": 503, "code": "SlowDown", "times": 2}``: an S3 error response
  (throttling, access denied, ...) for the first ``times`` matching requests (``null``: all);
- ``{"match": "PUT .*/part-", "action": "die", "after": 1}``: the process exits at once, mid-request,
  on the matching request after the first ``after`` ones (a store that crashes mid-write); the
  test starts a new proxy on the same port, and moto still holds what was written before;
- ``{"match": "^(PUT|DELETE) ", "action": "strip"}``: the request is forwarded without its
  conditional headers (``If-None-Match``, ``If-Match``; ``"headers"`` names others), as a store
  that ignores S3's conditional writes applies them: as plain ones;
- ``{"match": "^(PUT|DELETE) ", "conditional": true, "status": 501, "code": "NotImplemented"}``: a
  rule with ``conditional`` applies only to requests that carry one of those headers, so the store
  answers the conditional requests with an error and serves every other one (a store that does
  not support S3's conditional writes and says so).

``match`` is a regular expression searched in ``"<METHOD> <path>?<query>"``. Every request is logged
as one JSON line (``method``, ``target``, ``status``, ``injected``) to ``--log``, so a test can assert
which faults the clients actually met. Standard library only: it starts in a fraction of a second
(:class:`FaultProxy`, the tests' handle on one, imports the test helpers when it is used).

    python -m tests.s3_proxy --port 9100 --upstream http://127.0.0.1:9000 --rules '[...]' --log proxy.log
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from tests.conftest import BackgroundServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}
_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
    "<Resource>{resource}</Resource><RequestId>batchinfer-fault-proxy</RequestId></Error>"
)


class Rule:
    def __init__(self, spec: dict) -> None:
        self.pattern = re.compile(spec["match"])
        self.action = spec.get("action", "status")
        self.status = int(spec.get("status", 503))
        self.code = spec.get("code", "SlowDown")
        self.message = spec.get("message", "injected by the batchinfer test proxy")
        self.times = spec.get("times")
        self.after = int(spec.get("after", 0))
        self.headers = {h.lower() for h in spec.get("headers", ("If-None-Match", "If-Match"))}
        self.conditional = bool(spec.get("conditional", False))
        self.seen = 0
        self.fired = 0

    def applies(self, request_line: str, headers: list[str]) -> bool:
        """Counts matching requests; True when this one is to be answered by the rule. ``headers``:
        the names of the request's headers."""
        if not self.pattern.search(request_line):
            return False
        if self.conditional and not self.headers & {h.lower() for h in headers}:
            return False
        self.seen += 1
        if self.seen <= self.after or (self.times is not None and self.fired >= self.times):
            return False
        self.fired += 1
        return True


class Proxy(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, upstream: str, rules: list[dict], log_path: str) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rules = [Rule(r) for r in rules]
        self.lock = threading.Lock()
        self.log = open(log_path, "a", buffering=1)

    def record(self, **entry) -> None:
        with self.lock:
            self.log.write(json.dumps(entry) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and 100-continue, as S3 clients expect
    # a response's headers and body are written apart: with Nagle's algorithm on, each response then
    # waits out the client's delayed ACK (~40 ms), several times what the request itself costs
    disable_nagle_algorithm = True
    server: Proxy

    def log_message(self, format: str, *args) -> None:  # the JSON log is the record
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        line = f"{self.command} {self.path}"
        with self.server.lock:
            rule = next((r for r in self.server.rules if r.applies(line, list(self.headers))), None)
        if rule is not None and rule.action == "die":
            self.server.record(method=self.command, target=self.path, status=None, injected="die")
            os._exit(17)  # mid-request: the client gets a reset connection and no answer, like a crash
        body = self._body()
        stripped: set[str] = set()
        if rule is not None and rule.action == "strip":
            stripped, rule = rule.headers, None
        if rule is not None:
            payload = (
                b""
                if self.command == "HEAD"
                else _ERROR_BODY.format(code=rule.code, message=rule.message, resource=self.path.split("?")[0]).encode()
            )
            # recorded before the client has its answer: a test that reads the log once its call
            # returned then sees every request the call made
            self.server.record(method=self.command, target=self.path, status=rule.status, injected=rule.code)
            self.send_response(rule.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=120)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if (
                    name.lower() not in _HOP_BY_HOP
                    and name.lower() != "content-length"
                    and name.lower() not in stripped
                ):
                    conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        dropped = sorted(h for h in self.headers if h.lower() in stripped)
        self.server.record(
            method=self.command, target=self.path, status=response.status, injected="strip" if dropped else None
        )
        self.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        # HEAD: moto's Content-Length is the object's size, and there is no body to count
        length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
        self.send_header("Content-Length", length or "0")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class FaultProxy:
    """``tests/s3_proxy.py`` on one fixed port for a test; ``start`` again after it died (or to change
    the rules) serves the same endpoint, so the connection never changes."""

    def __init__(self, upstream: str, log: Path) -> None:
        from tests.conftest import _free_port

        self.upstream, self.log, self.port = upstream, log, _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server: BackgroundServer | None = None

    def start(self, *rules: dict) -> FaultProxy:
        from tests.conftest import BackgroundServer

        self.stop()
        self.server = BackgroundServer(
            f"s3-proxy-{self.port}",
            [
                sys.executable,
                "-m",
                "tests.s3_proxy",
                "--port",
                str(self.port),
                "--upstream",
                self.upstream,
                "--rules",
                json.dumps(list(rules)),
                "--log",
                str(self.log),
            ],
            ports=[self.port],
            timeout=30,
        )
        return self

    def alive(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(timeout=10)
            self.server = None

    def requests(self, since: int = 0) -> list[dict]:
        return read_log(str(self.log))[since:]


def read_log(path: str) -> list[dict]:
    """The requests a proxy (and its predecessors on the same log) saw, oldest first."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.s3_proxy")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the S3 server, e.g. http://127.0.0.1:9000")
    parser.add_argument("--rules", default="[]", help="JSON list of fault rules (see the module docstring)")
    parser.add_argument("--log", required=True, help="file that gets one JSON line per request")
    args = parser.parse_args(argv)
    Proxy(args.port, args.upstream, json.loads(args.rules), args.log).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
