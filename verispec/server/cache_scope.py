"""Which requests may share prefix-cache blocks: only those of one API key, and with a request's own
`cache_salt` only those sending the same salt.

A shared block is visible: `cached_tokens` and the time to first token tell a client whether a
guessed prefix (another client's system prompt, a secret in it) is cached. So the salt the engine
mixes into the block hashes (cache/prefix.py) carries the key's id; without `--api-key` every client
is one tenant and only `cache_salt` separates them (as vLLM's does).
"""
from __future__ import annotations

import json

from verispec.server.auth import KEY_ID_SCOPE


def cache_salt(scope: dict, requested_salt: str | None) -> str | None:
    """The engine's cache salt for a request (None: the shared, unsalted cache)."""
    key = scope.get(KEY_ID_SCOPE)
    if key is None and requested_salt is None:
        return None
    return json.dumps([key, requested_salt])  # unambiguous: no (key, salt) pair spells another's
