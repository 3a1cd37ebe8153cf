"""The supervisor's one event loop: one thread, one selector (pidfds, the control socket and its
connections, the inbox), and a heap of timers. Nothing here knows what a unit is.

Other threads (the log router, the health probes) never touch the supervisor's state: they `post` to the
inbox, a queue with a wakeup pipe, and the loop's thread takes each item in turn. Signal handlers post
there too (signal.set_wakeup_fd wakes the selector).
"""

from __future__ import annotations

import heapq
import itertools
import os
import selectors
import time
from collections import deque
from typing import Callable


class Loop:
    def __init__(self, on_item: Callable[[object], None]):
        """`on_item` takes each item posted to the inbox, on the loop's thread."""
        self.selector = selectors.DefaultSelector()
        self.on_item = on_item
        self.items: deque = deque()  # (append and popleft are safe across threads)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.order = itertools.count()

    def post(self, item: object) -> None:
        """From any thread: hand `item` to the loop."""
        self.items.append(item)
        try:
            os.write(self.wake_w, b"!")
        except (BlockingIOError, OSError):
            pass  # (full: the loop wakes anyway; closed: the loop is over)

    def watch(self, fd: int, on_ready: Callable[[], None]) -> None:
        """Call `on_ready()` whenever `fd` is readable, until `forget(fd)`."""
        self.selector.register(fd, selectors.EVENT_READ, on_ready)

    def forget(self, fd: int) -> None:
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _watched(self, key: selectors.SelectorKey) -> bool:
        try:
            return self.selector.get_key(key.fileobj).data is key.data
        except KeyError:
            return False

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Call `callback()` once time.monotonic() has reached `when`."""
        heapq.heappush(self.timers, (when, next(self.order), callback))

    def once(self, max_wait: float = 1.0) -> None:
        """Wait for at most `max_wait` s (less when a timer is due sooner), then run what is ready: the
        inbox's items, the ready fds' callbacks, the due timers."""
        wait = max_wait
        if self.timers:
            wait = min(wait, max(0.0, self.timers[0][0] - time.monotonic()))
        if self.items:
            wait = 0.0
        for key, _ in self.selector.select(wait):
            if key.data is None:
                try:
                    while os.read(self.wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif self._watched(key):  # (an earlier callback may have forgotten it, and its fd number reused)
                key.data()
        while self.items:
            self.on_item(self.items.popleft())
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            heapq.heappop(self.timers)[2]()

    def close(self) -> None:
        self.selector.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
