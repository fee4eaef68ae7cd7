"""The hosts a job may fetch ``http(s)`` references from (the connection's ``allowed_url_hosts``).

Both sides read the list through :func:`parse_url_hosts`: the hook when it parses the connection,
the runtime when it reads the job file, so an entry the runtime would misread never reaches it.
Entries are host names (``cdn.example.com``), ``*.`` patterns (``*.images.example.com``, any
subdomain), ``*`` (any host), IP addresses and CIDR networks (``10.0.0.0/8``). Empty means that no
URL is fetched at all. Which *addresses* a matched host may resolve to is the runtime's rule
(``runtime/model/url_fetch.py``): a pattern never reaches a private, loopback or link-local address,
nor an IPv6 address that carries an IPv4 one (NAT64, 6to4, Teredo, IPv4-mapped); an entry that
names the host or its network does.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$"
)
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def network(entry: str) -> IpNetwork | None:
    """The entry as an IP network (an address is a /32 or /128), or None when it is a host name."""
    if not re.fullmatch(r"[0-9a-fA-F:.]+(/\d+)?", entry) or not any(c.isdigit() for c in entry):
        return None
    try:
        return ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        return None


def _check_entry(entry: str, where: str, error: type[Exception]) -> str:
    entry = entry.strip().lower().rstrip(".")
    bad = f"{where}: allowed_url_hosts entry {entry!r}"
    if entry == "*" or network(entry) is not None:
        return entry
    if (
        re.fullmatch(r"[0-9a-f:./]+", entry)
        and re.fullmatch(r"[0-9./]+|.*[/:].*", entry)
        and any(c.isdigit() for c in entry)
    ):
        raise error(f"{bad} is not a valid IP address or CIDR network")
    if any(c in entry for c in ":/@?#"):
        raise error(f"{bad}: write host names (cdn.example.com), not URLs, ports or paths")
    name = entry[2:] if entry.startswith("*.") else entry
    if "*" in name:
        raise error(f"{bad}: a wildcard is '*' alone or '*.' before a domain (*.images.example.com)")
    if not _HOST_NAME.match(name):
        raise error(f"{bad} is not a host name, '*.' pattern, IP address or CIDR network")
    return entry


def parse_url_hosts(value: Any, where: str, error: type[Exception]) -> tuple[str, ...]:
    """The entries, normalized (lower case, no trailing dot) and checked; ``()`` for empty.

    ``value`` is a list, a JSON list as text or a comma-separated string (the connection form)."""
    if value in (None, "", []):
        return ()
    if isinstance(value, str):
        if value.strip().startswith("["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: allowed_url_hosts is not a valid JSON list ({exc})") from None
        else:
            value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise error(f"{where}: allowed_url_hosts must be a list of host names, got {value!r:.120}")
    return tuple(dict.fromkeys(_check_entry(v, where, error) for v in value if v.strip()))


def host_match(host: str, entries: tuple[str, ...] | list[str]) -> str | None:
    """How ``host`` is allowed: ``"named"`` (an entry is the host itself, or an IP network holding
    it), ``"pattern"`` (``*`` or a ``*.`` pattern) or None (not allowed)."""
    host = host.lower().rstrip(".")
    literal = network(host)
    how = None
    for entry in entries:
        net = network(entry)
        if entry == host or (net is not None and literal is not None and _holds(net, literal)):
            return "named"
        if entry == "*" or (entry.startswith("*.") and host.endswith(entry[1:]) and literal is None):
            how = "pattern"
    return how


def address_named(address: str, entries: tuple[str, ...] | list[str]) -> bool:
    """Whether an IP entry (address or network) in ``entries`` holds ``address``."""
    target = network(address)
    return target is not None and any((net := network(e)) is not None and _holds(net, target) for e in entries)


def _holds(net: IpNetwork, target: IpNetwork) -> bool:
    return net.version == target.version and target.subnet_of(net)  # type: ignore[arg-type]
