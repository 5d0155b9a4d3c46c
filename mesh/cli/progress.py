"""Progress of a pool's weight transfers, for `deltamesh pool sync` and `deltamesh pool run`.

`TransferProgress.watch(sync)` sets a `WeightSync`'s `on_progress` hook, which tells it the transfer
under way (`WeightSync.transfer`: versions from and to, bytes_total, bytes_done, started) as it
starts, as each verified piece arrives and once the version is applied; nothing is counted twice,
these are the bytes the heartbeats report to the gateway. When stderr is a terminal it draws a rich
bar per transfer, shown only while one runs (the log lines print above it); otherwise (a service
manager's journal, a file, a pipe) it logs a line every `LOG_EVERY_S` seconds while a transfer runs,
with the version, the bytes fetched of the total and the rate, so that a long transfer is seen to
move. Either way one line says what each applied version took. It only reads what the hook passes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from deltamesh.mesh.pool.weight_sync import WeightSync

log = logging.getLogger(__name__)

LOG_EVERY_S = 5.0
"""Seconds between two progress lines of one transfer when stderr is not a terminal."""


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def versions(transfer: dict[str, Any]) -> str:
    """`v3 -> v4`, or `v4 (full)` for a full snapshot taken from nothing."""
    base, to = transfer.get("from"), transfer.get("to")
    return f"v{base} -> v{to}" if base is not None else f"v{to} (full)"


def describe(name: str, model: str, transfer: dict[str, Any], now: float) -> str:
    """One progress line: `pool eu-1: policy v3 -> v4: 12.0 MiB of 40.0 MiB (30%), 8.1 MiB/s`."""
    done, total = transfer.get("bytes_done", 0), transfer.get("bytes_total", 0)
    elapsed = max(now - transfer.get("started", now), 1e-6)
    way = versions(transfer)
    share = f" ({100 * done / total:.0f}%)" if total else ""
    if "applied" in transfer:
        return f"pool {name}: {model} {way}: fetched {mib(done)} in {elapsed:.1f} s, {mib(done / elapsed)}/s"
    return f"pool {name}: {model} {way}: {mib(done)} of {mib(total)}{share}, {mib(done / elapsed)}/s"


class TransferProgress:
    """The transfers of the weight streams it watches, on stderr. `tty`: draw bars (default: whether
    stderr is a terminal); `clock`: the time, for tests."""

    def __init__(self, *, tty: bool | None = None, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.every_s = every_s
        self.clock = clock
        self._logged: dict[int, float] = {}  # per watched sync: when its last line was logged
        self._bars: Progress | None = None
        self._tasks: dict[int, TaskID] = {}
        self._moved: list[tuple[logging.StreamHandler, Any]] = []  # handlers pointed at rich's proxy, and their stream

    def watch(self, sync: WeightSync) -> None:
        sync.on_progress = lambda transfer: self.update(sync, transfer)

    def update(self, sync: WeightSync, transfer: dict[str, Any]) -> None:
        name, model = sync.config.name, sync.model or "?"
        now = self.clock()
        if "applied" in transfer:
            self._done(id(sync))
            log.info("%s", describe(name, model, transfer, now))
        elif self.tty:
            self._draw(id(sync), name, model, transfer)
        elif now - self._logged.setdefault(id(sync), now) >= self.every_s:
            self._logged[id(sync)] = now
            log.info("%s", describe(name, model, transfer, now))

    def close(self) -> None:
        """Take the bars down (a transfer cut short by a stop or a failure leaves none behind)."""
        for key in list(self._tasks):
            self._done(key)

    # -- the terminal's bars ------------------------------------------------------------------------
    def _draw(self, key: int, name: str, model: str, transfer: dict[str, Any]) -> None:
        if self._bars is None:
            self._bars = self._start_bars()
        shown = {"description": f"pool {name}: {model} {versions(transfer)}",
                 "total": transfer.get("bytes_total") or None, "completed": transfer.get("bytes_done", 0)}
        if key in self._tasks:
            self._bars.update(self._tasks[key], **shown)
        else:
            self._tasks[key] = self._bars.add_task(**shown)
            self._bars.refresh()  # drawn at once: a short transfer may end before rich's next refresh

    def _done(self, key: int) -> None:
        self._logged.pop(key, None)
        task = self._tasks.pop(key, None)
        if task is not None and self._bars is not None:
            self._bars.remove_task(task)
        if not self._tasks and self._bars is not None:
            bars, self._bars = self._bars, None
            bars.stop()
            self._restore()

    def _start_bars(self) -> Progress:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        bars = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), console=Console(stderr=True), transient=True)
        original = sys.stderr
        bars.start()  # on a terminal, sys.stderr is now rich's proxy, which prints above the bars
        if sys.stderr is not original:
            # A logging handler keeps the stream it was made with: point those on stderr at the proxy
            # while the bars are up, or their lines would tear through the bars.
            self._moved = [(h, h.setStream(sys.stderr)) for h in _handlers_on(original)]
        return bars

    def _restore(self) -> None:
        for handler, stream in self._moved:
            handler.setStream(stream)
        self._moved = []


def _handlers_on(stream: TextIO) -> Iterator[logging.StreamHandler]:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
            yield handler


@contextlib.contextmanager
def transfer_progress(**options: Any) -> Iterator[TransferProgress]:
    """A `TransferProgress` whose bars are taken down when the block ends, however it ends."""
    progress = TransferProgress(**options)
    try:
        yield progress
    finally:
        progress.close()
