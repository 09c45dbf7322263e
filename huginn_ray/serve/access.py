"""Who may use the server: the API key every request must carry, and the addresses that may go without one.

    check_access(host, api_key)               # the driver's plan, before Ray starts: ValueError naming the option
    authorized(authorization_header, api_key)  # each request (the server answers 401 when False)

The key is compared in constant time (hmac.compare_digest), so the time of a refusal does not tell a guess how
much of the key it got right. Without a key the server is open to whoever reaches its address, so only a
loopback address may go without one (vLLM's OpenAI server asks the same `Authorization: Bearer <key>`).
"""

from __future__ import annotations

import hmac
import ipaddress

API_KEY_ENV = "HUGINN_API_KEY"
"""The environment variable that gives jobs/serve.py's --api-key when the option is not passed (it keeps the key
out of the process list)."""


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback only: localhost, 127.0.0.0/8 or ::1 (any other name: no)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_access(host: str, api_key: str | None) -> None:
    """Refuse (ValueError naming the option) an empty key, and an address beyond loopback without a key."""
    if api_key is not None and not api_key.strip():
        raise ValueError(f"--api-key (or ${API_KEY_ENV}) is empty: give a key, or leave both unset")
    if api_key is None and not is_loopback(host):
        raise ValueError(f"--host {host} is not a loopback address: whoever reaches it could use this server and "
                         f"its compute; pass --api-key KEY (or set ${API_KEY_ENV}) so that every request needs "
                         f"`Authorization: Bearer KEY`, or listen on 127.0.0.1")


def authorized(authorization: str | None, api_key: str | None) -> bool:
    """Whether a request whose Authorization header is `authorization` (None: absent) may be served."""
    if api_key is None:
        return True
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {api_key}".encode())
