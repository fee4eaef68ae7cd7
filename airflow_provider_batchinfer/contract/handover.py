"""The hand-over of a job to a spare runtime process: names and wire format shared by the
``local`` launcher (``launchers/embedded/warm_runtime.py``) and the spare (``runtime/spare.py``).

A spare listens on ``<kind>.<pid>.sock`` once it is ready; ``….sock.starting`` marks one still
importing; a launcher claims a spare by renaming its socket to ``….sock.claimed``. The request is
one length-prefixed JSON object ``{args, env, cwd}``, sent with the job's output pipe attached; the
spare answers with JSON lines, ``{"pid": …}`` then ``{"exit": …}`` (or ``{"refused": …}``).
Each side checks the other's kernel-reported credentials first: the request carries the job's
environment, credentials included, so the launcher sends it only to the spare its socket's name
says (that pid, this uid), and a spare takes a job only from this uid.
Imports neither side.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

LENGTH = struct.Struct("!I")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_name(kind: str, pid: int) -> str:
    return f"{kind}.{pid}.sock"


def claimed_name(name: str) -> str:
    return f"{name}.claimed"


def starting_name(name: str) -> str:
    return f"{name}.starting"


def pid_of(name: str) -> int:
    """The spare's pid in one of its file names (0 for any other name)."""
    try:
        return int(name.split(".")[1])
    except (IndexError, ValueError):
        return 0


def encode_request(request: dict[str, Any]) -> bytes:
    body = json.dumps(request).encode()
    return LENGTH.pack(len(body)) + body


def request_length(data: bytes) -> int | None:
    """The whole request's length in bytes once its prefix has arrived, else None."""
    if len(data) < LENGTH.size:
        return None
    return LENGTH.size + int(LENGTH.unpack_from(data)[0])


def decode_request(data: bytes) -> dict[str, Any]:
    request: dict[str, Any] = json.loads(data[LENGTH.size :])
    return request


def encode_message(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket, as the kernel
    recorded them when it connected or listened (``SO_PEERCRED``): not something the peer can claim."""
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid
