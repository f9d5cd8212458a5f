"""What a paywalled request is: its method, route, path and query in one canonical form, and the keys naming it.

The paywall must never let a header choose what a token is for. So:

- The **host is never part of a key.** A WSGI server pastes the raw ``Host`` header into any URL it
  rebuilds (``wsgiref.util.request_uri``); a ``Host: x/premium?id=1#`` would then name another
  resource. Keys are made from the method, the route and the path and query as the application
  sees them (``SCRIPT_NAME`` + ``PATH_INFO``, ``QUERY_STRING``), each passed separately.
- **Percent-encoded, both sides.** WSGI gives the path decoded (bytes as latin-1 text), the query
  still encoded; a client sends both encoded. :func:`canonical_path` encodes the decoded path and
  :func:`canonical_query` normalises the encoded query, so ``/r/€?q=café`` reads
  ``/r/%E2%82%AC?q=caf%C3%A9`` however it was spelled.
- **HEAD is GET** (a WSGI app answers HEAD with GET's view): one price, one key.
- :func:`route_path` is the form the middleware matches its configured routes in (no empty or dot
  segments, no trailing slash), so ``/report/`` and ``//report`` are charged like ``/report``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import quote, urlsplit

__all__ = [
    "PaidRequest",
    "canonical_method",
    "canonical_origin",
    "canonical_path",
    "canonical_query",
    "digest",
    "display_url",
    "price_text",
    "route_path",
]

_PATH_SAFE = "/!$&'()*+,;=:@-._~"  # RFC 3986 pchar and "/": left as they are
_QUERY_SAFE = _PATH_SAFE + "?%"  # "%": the query string arrives still percent-encoded
_ESCAPE = re.compile(r"%[0-9a-fA-F]{2}")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?$")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def canonical_method(method: str) -> str:
    """The method a price and a key are for: upper case, HEAD as GET."""
    upper = str(method).upper()
    return "GET" if upper == "HEAD" else upper


def _raw_bytes(text: str | bytes) -> bytes:
    if isinstance(text, bytes):
        return text
    try:
        return text.encode("latin-1")  # PEP 3333: native strings carry the request's bytes as latin-1
    except UnicodeEncodeError:
        return text.encode("utf-8")  # a server (or Flask's request.path) that decoded them as UTF-8


def canonical_path(decoded: str | bytes) -> str:
    """A decoded path (WSGI's ``SCRIPT_NAME + PATH_INFO``) percent-encoded: unreserved and sub-delims kept."""
    path = quote(_raw_bytes(decoded), safe=_PATH_SAFE)
    return path if path.startswith("/") else "/" + path


def canonical_query(raw: str | bytes) -> str:
    """A query string as sent (still encoded): escapes in upper case, anything not allowed raw encoded."""
    return _ESCAPE.sub(lambda m: m.group(0).upper(), quote(_raw_bytes(raw), safe=_QUERY_SAFE))


def route_path(path: str) -> str:
    """The path as the middleware matches routes: no empty or ``.`` segments, ``..`` applied, no trailing slash."""
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def canonical_origin(url: str) -> str:
    """``scheme://host[:port]`` of a URL in lower case, without the scheme's default port ("" if none)."""
    split = urlsplit(str(url))
    if not split.scheme or not split.hostname:
        return ""
    host = split.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    try:
        port = split.port
    except ValueError:
        return ""
    if port is not None and str(port) != _DEFAULT_PORTS.get(split.scheme.lower()):
        host = f"{host}:{port}"
    return f"{split.scheme.lower()}://{host}"


def digest(*parts: str) -> str:
    """A short digest naming something by its parts."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


def price_text(price: Decimal) -> str:
    """A price as it is written into a token: ``0.25``, ``1``, ``100`` (no exponent, no trailing zeros)."""
    return format(price.normalize(), "f")


def display_url(environ: dict[str, Any], target: str, origin: str | None) -> str:
    """The URL a 402 shows (the x402 ``resource``): ``origin`` + target, else the request's own host when it
    is a plain host name (never used in a key), else the server's name."""
    if origin:
        return origin + target
    scheme = str(environ.get("wsgi.url_scheme") or "http")
    host = str(environ.get("HTTP_HOST") or "")
    if not _HOST.match(host):
        host = str(environ.get("SERVER_NAME") or "localhost")
        port = str(environ.get("SERVER_PORT") or "")
        if port and port != _DEFAULT_PORTS.get(scheme):
            host = f"{host}:{port}"
    return f"{scheme}://{host}{target}"


@dataclass(frozen=True)
class PaidRequest:
    """One priced request, with what each decision is keyed on.

    - ``key``: the resource a token, a claim and a challenge are for: the paywall's ``audience``, the
      method, the ``route`` and ``target`` (path and query; for the middleware, the configured route's
      path), never the host;
    - ``label``: the request as the client sent it (``GET /r/%E2%82%AC?q=1``), for logs.
    """

    method: str
    route: str
    target: str
    label: str
    price: Decimal
    audience: str
    url: str
    description: str
    client: str = ""

    @classmethod
    def make(
        cls,
        method: str,
        path: str,
        query: str,
        price: Decimal,
        *,
        audience: str,
        route: str | None = None,
        route_target: str | None = None,
        url: str | None = None,
        description: str | None = None,
        client: str = "",
    ) -> PaidRequest:
        """``path`` decoded (WSGI), ``query`` as sent; ``route_target`` replaces the path in the key
        (the middleware's configured route); ``route`` is the route template (default: the path)."""
        canonical_verb = canonical_method(method)
        asked = canonical_path(path)
        query_text = canonical_query(query)
        suffix = f"?{query_text}" if query_text else ""
        target = (route_target if route_target is not None else asked) + suffix
        chosen_route = route if route is not None else asked
        return cls(
            method=canonical_verb,
            route=chosen_route,
            target=target,
            label=f"{canonical_verb} {asked}{suffix}",
            price=price,
            audience=audience,
            url=url if url is not None else asked + suffix,
            description=description or f"{canonical_verb} {chosen_route}",
            client=client,
        )

    @property
    def key(self) -> str:
        return digest("resource", self.audience, self.method, self.route, self.target)
