"""``http(s)`` references in chat messages, fetched by the runtime itself, inside the allow-list.

Left in a message, an image URL reaches ``ray.data.llm``'s multimodal stage, which fetches any
address from inside the cluster: the cloud metadata endpoint (``169.254.169.254``) and every
internal service included. So the runtime fetches URLs itself and hands Ray ``data:`` URLs:

- the URL's host must match the connection's ``allowed_url_hosts`` (empty by default: no URL is
  fetched, and such a row fails with :class:`FileReferenceError`);
- the host is resolved once and *every* address is checked: a private, loopback, link-local or
  otherwise non-public address is refused unless the allow-list names the host or that address's
  network (``*`` and ``*.`` patterns never reach one, so a public name that resolves inward does
  not either);
- an IPv6 address that carries an IPv4 one (NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48``, 6to4
  ``2002::/16``, Teredo ``2001::/32``, IPv4-mapped and -compatible) is non-public whatever it
  carries: a gateway on the way turns it into that IPv4 address, which may be private (the error
  names it), so only an entry naming the host or the IPv6 network reaches it;
- the connection goes to an address that was checked (a second lookup could answer differently),
  with the host name kept for TLS verification and the ``Host`` header; redirects are not followed,
  and a body larger than :data:`MAX_URL_BYTES` is refused.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from airflow_provider_batchinfer.contract.url_hosts import address_named, host_match

MAX_URL_BYTES = 64 * 1024 * 1024  # one referenced image or clip; the row fails beyond it
TIMEOUT_S = 30.0
_KINDS = (
    ("is_loopback", "a loopback"),
    ("is_link_local", "a link-local"),
    ("is_private", "a private"),
    ("is_multicast", "a multicast"),
    ("is_unspecified", "an unspecified"),
    ("is_reserved", "a reserved"),
)


class UrlReferenceError(ValueError):
    """A URL that may not be fetched, or whose fetch failed; ``dereference`` reports it per row."""


@dataclass(frozen=True)
class CheckedUrl:
    """A URL that passed the allow-list: where to connect (only ``addresses``) and what to ask for."""

    scheme: str
    host: str
    port: int
    target: str  # path and query, as sent in the request line
    addresses: tuple[str, ...]


#: IPv6 ranges whose addresses a gateway translates to the IPv4 address they carry
_TRANSLATED = (
    (ipaddress.IPv6Network("64:ff9b::/96"), "NAT64"),
    (ipaddress.IPv6Network("64:ff9b:1::/48"), "local-use NAT64"),
    (ipaddress.IPv6Network("2002::/16"), "6to4"),
    (ipaddress.IPv6Network("2001::/32"), "Teredo"),
    (ipaddress.IPv6Network("::ffff:0:0/96"), "IPv4-mapped"),
    (ipaddress.IPv6Network("::/96"), "IPv4-compatible"),
)


def _kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    for attribute, kind in _KINDS:
        if getattr(ip, attribute):
            return kind
    return None if ip.is_global else "a non-public"


def _carried(ip: ipaddress.IPv6Address, label: str) -> list[ipaddress.IPv4Address]:
    """The IPv4 address(es) a translated address carries (Teredo: its server and its client)."""
    if label == "6to4":
        return [ip.sixtofour] if ip.sixtofour else []
    if label == "Teredo":
        return list(ip.teredo) if ip.teredo else []
    if label == "local-use NAT64":  # where the IPv4 address sits depends on the operator's prefix length
        return []
    return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]


def _address_kind(address: str) -> str | None:
    """None for a public address, else what it is ("a link-local address", ...)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and not (ip.is_loopback or ip.is_unspecified):
        for network, label in _TRANSLATED:
            if ip in network:
                inner = _carried(ip, label)
                kinds = [kind for v4 in inner if (kind := _kind(v4))]
                carries = f" of {', '.join(map(str, inner))}" if inner else ""
                return f"{kinds[0] if kinds else 'a translated'} address ({label}{carries})"
    kind = _kind(ip)
    return f"{kind} address" if kind else None


def check_url(
    url: str, allowed: tuple[str, ...] | list[str], resolve: Callable[..., Any] = socket.getaddrinfo
) -> CheckedUrl:
    """The URL's host and resolved addresses when the allow-list admits them; UrlReferenceError otherwise."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UrlReferenceError(f"only http and https URLs can be fetched, not {scheme}://")
    if parts.username is not None or parts.password is not None:
        raise UrlReferenceError("credentials in a URL are not sent; serve the file from an allowed host without them")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise UrlReferenceError("the URL has no host")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError as exc:
        raise UrlReferenceError(f"bad port ({exc})") from None
    if not allowed:
        raise UrlReferenceError(
            "http(s) references are not fetched: the connection's allowed_url_hosts is empty. Put the file under "
            "an allowed root, or add its host to allowed_url_hosts"
        )
    how = host_match(host, tuple(allowed))
    if how is None:
        raise UrlReferenceError(
            f"host {host!r} is not in the connection's allowed_url_hosts ({', '.join(allowed)}); add it there"
        )
    try:
        infos = resolve(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UrlReferenceError(f"cannot resolve host {host!r}: {exc}") from None
    addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise UrlReferenceError(f"host {host!r} resolves to no address")
    for address in addresses:
        kind = _address_kind(address)
        if kind and how != "named" and not address_named(address, tuple(allowed)):
            raise UrlReferenceError(
                f"host {host!r}: {address} is {kind}, which a URL reaches only when allowed_url_hosts "
                "names the host or its network"
            )
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return CheckedUrl(scheme, host, port, target, addresses)


def _connection(checked: CheckedUrl, address: str) -> http.client.HTTPConnection:
    """A connection to ``address`` that still speaks to (and, for https, verifies) ``checked.host``."""
    conn: http.client.HTTPConnection
    if checked.scheme == "https":
        conn = http.client.HTTPSConnection(
            checked.host, checked.port, timeout=TIMEOUT_S, context=ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(checked.host, checked.port, timeout=TIMEOUT_S)

    def connect_checked(_where: Any, timeout: Any = TIMEOUT_S, source: Any = None) -> socket.socket:
        return socket.create_connection((address, checked.port), timeout, source)

    conn._create_connection = connect_checked  # type: ignore[attr-defined]
    return conn


def fetch_url(
    url: str, allowed: tuple[str, ...] | list[str], resolve: Callable[..., Any] = socket.getaddrinfo
) -> tuple[bytes, str | None]:
    """The body and ``Content-Type`` of one allowed URL (see the module's rules)."""
    checked = check_url(url, allowed, resolve)
    conn = _connection(checked, checked.addresses[0])
    try:
        conn.request("GET", checked.target, headers={"User-Agent": "airflow-provider-batchinfer"})
        response = conn.getresponse()
        if response.status != 200:
            where = " redirects are not followed" if 300 <= response.status < 400 else ""
            raise UrlReferenceError(f"the server answered {response.status};{where or ' expected 200'}")
        body = response.read(MAX_URL_BYTES + 1)
        if len(body) > MAX_URL_BYTES:
            raise UrlReferenceError(f"the body is more than {MAX_URL_BYTES} bytes")
        content_type = response.getheader("Content-Type")
    except (OSError, http.client.HTTPException) as exc:
        raise UrlReferenceError(f"cannot fetch it: {exc}") from None
    finally:
        conn.close()
    mime = content_type.split(";", 1)[0].strip().lower() if content_type else None
    return body, (mime if mime and "/" in mime else None)
