"""`release_abandoned`: slots made for a client that left before learning their ids are freed
and the abandoned response counted, the same way on every front end (HTTP's
`service.http.abandon.Abandonment`, the framed socket's request loop)."""
from __future__ import annotations

import logging
from contextlib import suppress
from typing import Awaitable, Callable, Sequence

from prometheus_client import Counter

log = logging.getLogger("kda_serve.abandon")


async def release_abandoned(free: Callable[[str], Awaitable[None]], counter: Counter,
                            missing: tuple[type[Exception], ...], created: Sequence[str]) -> None:
    """Free ``created`` through ``free`` (a core's, single or sharded; a slot already gone,
    one of the ``missing`` errors, is skipped) and count one abandoned response in ``counter``."""
    for slot_id in created:
        with suppress(*missing):
            await free(slot_id)
    counter.inc()
    log.info("client gone before its response; freed the %d slot(s) made for it", len(created))
