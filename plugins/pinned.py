"""``pinned``: warm and pin the prefixes listed in ``cache.pinned`` when an engine starts.

Each entry is computed once (``engine.warm``) and its full blocks are pinned in the backend, so
every later request that starts with it hits on the device, whatever the eviction pressure::

    cache:
      pinned:
        - {text: "You are a helpful assistant.", chat: true, salt: tenant-a}
        - {token_ids: [1, 2, 3, 4]}

``chat: true`` renders ``text`` with the model's chat template as a system message (without the
assistant prompt), which is how a later conversation with that system prompt begins.
"""
from __future__ import annotations

import logging
from typing import Any

from corekv.errors import ConfigError
from corekv.plugin import hookimpl

logger = logging.getLogger(__name__)


def pinned_prompt(entry: Any) -> Any:
    """The prompt ``engine.warm`` receives for a ``cache.pinned`` entry.

    NOTE: ``load_config`` already guarantees exactly one of ``text`` / ``token_ids`` and ``chat``
    only with ``text``; the entry is read as it is.
    """
    if entry.token_ids is not None:
        return list(entry.token_ids)
    return [{"role": "system", "content": entry.text}] if entry.chat else entry.text


@hookimpl
def corekv_on_engine_started(engine: Any) -> None:
    """Warm and pin every ``cache.pinned`` entry; an error names the entry (``cache.pinned[2]``)."""
    for index, entry in enumerate(engine.config.cache.pinned):
        prompt = pinned_prompt(entry)
        try:
            num_tokens = engine.warm(prompt, pin=True, cache_salt=entry.salt, priority=entry.priority)
        except Exception as e:
            raise ConfigError(f"cache.pinned[{index}] ({_describe(entry)}) could not be warmed and "
                              f"pinned: {e}") from e
        if num_tokens == 0:
            logger.warning("cache.pinned[%d] (%s) is shorter than one block of %d tokens: nothing "
                           "was pinned", index, _describe(entry), engine.block_size)
        else:
            logger.info("pinned cache.pinned[%d] (%s): %d tokens", index, _describe(entry), num_tokens)


def _describe(entry: Any) -> str:
    if entry.text is not None:
        text = entry.text if len(entry.text) <= 40 else entry.text[:40] + "..."
        what = f"text {text!r}"
    else:
        what = f"{len(entry.token_ids or ())} token ids"
    return what + (f", salt {entry.salt!r}" if entry.salt else "")
