"""Credentials out of everything logged: URIs in MLflow params, console lines and manifests.

`https://user:pass@host/x?token=t` becomes `https://user:***@host/x?token=***`: the password (or a bare user-info
token) and secret-looking query values are replaced; a URI without credentials is returned unchanged.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit

SECRET_QUERY = re.compile(r"token|secret|password|passwd|key|signature|sig$|credential")
URI = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]+")


def redact_uri(uri: str) -> str:
    """`https://user:pass@host/x?token=t` -> `https://user:***@host/x?token=***`: the password (or a bare
    user-info token) and secret-looking query values are replaced."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return re.sub(r"//[^/@\s]*@", "//***@", uri)
    redacted = uri
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        redacted = redacted.replace(parts.netloc, f"{user}:***@{host}" if user else f"***@{host}", 1)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(SECRET_QUERY.search(k.lower()) for k, _ in pairs):
            query = urlencode([(k, "***" if SECRET_QUERY.search(k.lower()) else v) for k, v in pairs], safe="*")
            redacted = redacted.replace("?" + parts.query, "?" + query, 1)
    return redacted


def redact(text: str) -> str:
    """Every URI inside `text` with its credentials redacted (console lines, params, manifests)."""
    return URI.sub(lambda m: redact_uri(m.group(0)), text)
