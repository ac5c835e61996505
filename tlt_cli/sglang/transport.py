"""HTTP to one SGLang server: JSON in, JSON out, the API key on every call, proxies bypassed.

`ServerEndpoint` names a server (index, base URL, API key). `get_status` answers health polls
without raising; `get_json` and `post_json` raise `SGLangRequestError` with one sentence naming
the server, the path and what it answered. Only the standard library is used, so the CPU
install needs nothing more.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

# loopback servers must never be reached through an HTTP proxy from the environment
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
ERROR_BODY_CHARS = 300


class SGLangRequestError(RuntimeError):
    """An SGLang server refused, failed or did not answer a request."""


@dataclass(frozen=True)
class ServerEndpoint:
    """Server `index` at `url` (http://127.0.0.1:PORT), reached with `api_key`."""

    index: int
    url: str
    api_key: str


def _request(endpoint: ServerEndpoint, path: str, body: dict | None) -> urllib.request.Request:
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    return urllib.request.Request(
        endpoint.url + path, data=data, headers=headers, method="GET" if body is None else "POST"
    )


def get_status(endpoint: ServerEndpoint, path: str, timeout_s: float) -> int | None:
    """HTTP status of GET `path`, or None when nothing answers (refused, reset, timed out)."""
    try:
        with _OPENER.open(_request(endpoint, path, None), timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return None


def _exchange(endpoint: ServerEndpoint, path: str, body: dict | None, timeout_s: float) -> dict:
    where = f"SGLang server {endpoint.index} ({endpoint.url}{path})"
    try:
        with _OPENER.open(_request(endpoint, path, body), timeout=timeout_s) as response:
            payload = response.read()
    except urllib.error.HTTPError as error:
        detail = error.read()[:ERROR_BODY_CHARS].decode(errors="replace")
        hint = " (wrong API key?)" if error.code in (401, 403) else ""
        raise SGLangRequestError(f"{where} answered HTTP {error.code}{hint}: {detail}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise SGLangRequestError(
            f"{where} did not answer within {timeout_s:.0f} s or refused the connection: {reason}."
        ) from None
    try:
        return json.loads(payload)
    except json.JSONDecodeError:
        raise SGLangRequestError(
            f"{where} answered with something that is not JSON: {payload[:ERROR_BODY_CHARS]!r}."
        ) from None


def get_json(endpoint: ServerEndpoint, path: str, timeout_s: float) -> dict:
    """GET `path` and decode its JSON answer."""
    return _exchange(endpoint, path, None, timeout_s)


def post_json(endpoint: ServerEndpoint, path: str, body: dict, timeout_s: float) -> dict:
    """POST `body` as JSON to `path` and decode the JSON answer."""
    return _exchange(endpoint, path, body, timeout_s)
