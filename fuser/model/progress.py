"""progress: what ``fuser.apply`` says while it fuses a model — a record on the ``fuser``
logger for each layer structure and each other module it fuses or leaves eager, with the
seconds it took, and, on a terminal, a progress bar over the layers once the work has run for
a few seconds (tqdm, where it is installed; the log records alone otherwise)."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("fuser")

#: Seconds of work before the bar appears: a model fused faster shows none.
BAR_DELAY = 3.0


class Progress:
    def __init__(self, model: str, layers: int):
        self.model = model
        self.started = time.perf_counter()
        self.bar = _bar(model, layers)

    def advance(self, layers: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(layers)

    def note(self, message: str, *args, since: float | None = None) -> None:
        took = time.perf_counter() - (self.started if since is None else since)
        log.info("fuser: %s: " + message + " (%.1f s)", self.model, *args, took)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.note("done")


def _bar(model: str, layers: int):
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=layers, desc=f"fuser: {model}", unit="layer", delay=BAR_DELAY, leave=False)
