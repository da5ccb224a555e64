"""The first layer: only our own Host names and allowed Origins (H-ORIGIN-1/2, DNS rebinding)."""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers

from service.config import Settings, is_loopback_host
from service.mcp.refusal import http_refusal


def _hostname(url: str) -> str:
    """The host of a URL-ish header value; '' (never an exception) when it is malformed."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


class HostGuard:
    """Host: the public URL's name, the allow-list, loopback when bound to loopback. Origin (when
    sent): the public URL's, the allow-list, loopback when bound to loopback."""

    def __init__(self, settings: Settings) -> None:
        public = urlsplit(settings.effective_public_url)
        self._public_host = (public.hostname or "").lower()
        self._public_origin = f"{public.scheme}://{public.netloc}".lower()
        self._host_allowlist = settings.host_allowlist
        self._origin_allowlist = settings.origin_allowlist
        self._loopback = is_loopback_host(settings.host)
        self._hosts: dict[str, bool] = {}

    def host_allowed(self, host: str) -> bool:
        """Remembered per Host value (settings do not change while serving; a bounded table)."""
        known = self._hosts.get(host)
        if known is not None:
            return known
        hostname = _hostname(f"//{host}")
        allowed = (
            hostname == self._public_host
            or hostname in self._host_allowlist
            or (self._loopback and is_loopback_host(hostname))
        )
        if len(self._hosts) >= 1024:
            self._hosts.clear()
        self._hosts[host] = allowed
        return allowed

    def check(self, headers: Headers) -> None:
        host = headers.get("host", "")
        if not self.host_allowed(host):
            raise http_refusal(403, f"Host {host!r} is not served here (DNS rebinding protection)")
        origin = headers.get("origin")
        if origin is None:
            return
        origin_l = origin.rstrip("/").lower()
        if (
            origin_l == self._public_origin
            or origin_l in self._origin_allowlist
            or (self._loopback and is_loopback_host(_hostname(origin_l)))
        ):
            return
        raise http_refusal(403, f"Origin {origin!r} is not allowed; set MCP_TASKS_ALLOWED_ORIGINS")
