"""The `Host` allow-list: a page on another site cannot reach this server through DNS rebinding.

Rebinding points an attacker's domain name at 127.0.0.1, so the browser sends that name as `Host`;
refusing names this server was not told it answers to closes the hole. Allowed: localhost names,
loopback addresses, the address the server is bound to, and `--allowed-hosts` names (`*`: any,
`.example.com`: that domain and its subdomains). Bound to every interface (0.0.0.0, ::), any IP
literal is allowed as well: a rebinding page always sends a domain name, never an address.
"""
from __future__ import annotations

import ipaddress
import re

from verispec.server.errors import APIError, shorten

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$", re.I)


def host_name(header: str) -> str:
    """`Host` header -> the lower-case name or address without port or brackets."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:9999
        return header[1:header.find("]")] if "]" in header else header
    name, colon, port = header.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        header = name
    return header.rstrip(".")


def check_allowed_host(name: str) -> None:
    """A --allowed-hosts entry: '*', a name, '.domain', or an address (raises ValueError otherwise)."""
    bare = name.removeprefix(".")
    if name == "*" or HOST_NAME.match(bare) or (not name.startswith(".") and _is_address(bare.strip("[]"))):
        return
    raise ValueError(f"--allowed-hosts takes host names or addresses (or '*' for any, or '.domain' for a domain "
                     f"and its subdomains), without scheme, port or path; got {name!r}")


class HostPolicy:
    def __init__(self, bind_host: str, allowed_hosts: list[str] | tuple[str, ...] = ()):
        extra = [host_name(h) if not h.startswith(".") else h.lower() for h in allowed_hosts]
        self.any_host = "*" in extra
        self.suffixes = tuple(h for h in extra if h.startswith("."))
        self.names = set(LOCAL_NAMES) | {h for h in extra if not h.startswith(".")}
        bind = host_name(bind_host)
        self.any_address = bind in WILDCARD_BINDS
        if not self.any_address:
            self.names.add(bind)

    def allows(self, header: str | None) -> bool:
        if header is None or self.any_host:
            return True  # no Host at all: not a browser (every browser sends one)
        name = host_name(header)
        if name in self.names or name.endswith(".localhost"):
            return True
        if any(name.endswith(suffix) or name == suffix[1:] for suffix in self.suffixes):
            return True
        return self.any_address and _is_address(name)


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheckMiddleware:
    def __init__(self, app, policy: HostPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host")
            text = header.decode("latin-1") if header is not None else None
            if not self.policy.allows(text):
                error = APIError(400, f"this server does not answer to the Host {shorten(text)!r}; start it with "
                                      "--allowed-hosts NAME to allow a name", code="invalid_host")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
