"""Background upkeep of a served store: mirror the stream, apply updates, rebuild L1, record hot keys."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.backends.base.bounded_files import map_npy
from recserve.backends.store.tiered import TieredStore
from recserve.core.files import write_atomically
from recserve.errors import ArtifactError

if TYPE_CHECKING:
    from recserve.backends.store.updates.apply import StoreUpdater

LOGGER = logging.getLogger(__name__)

HOT_KEYS_FILE = "hot_keys.npy"


def save_hot_keys(folder: Path, keys: np.ndarray) -> None:
    """Record the hot keys (hottest first) for the next start's warm-up; atomic replace."""
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(
        folder / HOT_KEYS_FILE, lambda handle: np.save(handle, np.asarray(keys, np.int64), allow_pickle=False)
    )


def load_hot_keys(folder: Path) -> np.ndarray:
    """The recorded hot keys, or none (a missing file, or one whose header and size disagree)."""
    try:
        keys = map_npy(folder / HOT_KEYS_FILE)
    except (ArtifactError, OSError):
        return np.empty(0, np.int64)
    return keys.astype(np.int64).reshape(-1) if keys.dtype.kind == "i" else np.empty(0, np.int64)


class Maintainer:
    """Background upkeep of a served store: apply updates, rebuild L1, record hot keys.

    :attr:`rebuild_l1` is turned off by a step whose every table is resident on its device
    (:attr:`DeviceTier.whole <recserve.backends.store.device.tier.DeviceTier.whole>`): no key reads
    the host L1 there, so its rebuild every ``cache_refresh_s`` would be work for nothing.
    """

    def __init__(
        self,
        store: TieredStore,
        updater: StoreUpdater,
        state_dir: Path,
        interval_s: float,
        stream: Any | None = None,
    ) -> None:
        self.store = store
        self.updater = updater
        self.stream = stream  # an UpdateStream to mirror before each poll (Redis transport), or None
        self.state_dir = state_dir
        self.interval_s = interval_s
        self.after_step: list[Callable[[], None]] = []  # run after each round, on the upkeep thread
        #: rebuild L1 from the key frequencies when due (off when no key is served by the host L1)
        self.rebuild_l1 = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recserve-store", daemon=True)

    def _mirror(self) -> None:
        if self.stream is not None:
            try:
                self.stream.mirror()
            except Exception as exc:  # the directory transport keeps working
                LOGGER.warning("update stream unavailable: %s", type(exc).__name__)

    def warm_up(self) -> int:
        """Apply the current heads and preload L1 from the recorded hot keys; rows cached."""
        self._mirror()
        self.updater.poll()
        return self.store.refresh_cache(seed=load_hot_keys(self.state_dir))

    def start(self) -> Maintainer:
        """Start the background thread."""
        self._thread.start()
        return self

    def step(self) -> None:
        """One round of upkeep (what the thread does every ``interval_s``)."""
        self._mirror()
        self.updater.poll()
        if self.rebuild_l1 and self.store.refresh_due():
            self.store.refresh_cache()
            save_hot_keys(self.state_dir, self.store.hot_keys())
        for hook in self.after_step:
            hook()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # upkeep must never stop serving
                LOGGER.exception("store upkeep failed; serving the current snapshot")

    def stop(self) -> None:
        """Stop the thread (waits for the current round)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


__all__ = ["HOT_KEYS_FILE", "Maintainer", "load_hot_keys", "save_hot_keys"]
