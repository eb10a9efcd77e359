"""asyncio support: ``await future`` suspends the coroutine until the completion itself wakes the
loop (one eventfd per loop, which completing futures post to from any thread, GIL-free)."""
import asyncio
import itertools
import threading
import weakref

from . import _C


class _LoopWaker:
    """One per asyncio loop: the loop watches a ReadyNotifier's eventfd; completing futures post
    their waiter's token to it from whatever thread completes them, without taking the GIL."""

    __slots__ = ("notifier", "waiters", "_tokens", "__weakref__")

    def __init__(self, loop):
        self.notifier = _C.ReadyNotifier()
        # token -> asyncio.Future, touched only on the loop's thread. Weak: a waiter lives as long
        # as the dtorch future's wrapper (or a task awaiting it) holds it, so neither a closed loop
        # with pending awaits nor an abandoned future is kept alive from here.
        self.waiters = weakref.WeakValueDictionary()
        self._tokens = itertools.count()
        loop.add_reader(self.notifier.fileno(), self._drain)

    def register(self, loop):
        token = next(self._tokens)
        waiter = self.waiters[token] = loop.create_future()
        return token, waiter

    def _drain(self):
        for token in self.notifier.drain():
            waiter = self.waiters.pop(token, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)


# Weakly keyed: a loop that is gone takes its waker, and with it the eventfd (pending futures hold
# the notifier weakly), along.
_loop_wakers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]" = (
    weakref.WeakKeyDictionary()
)


_loop_wakers_lock = threading.Lock()  # event loops may run on several threads


def _waker_for(loop) -> _LoopWaker:
    waker = _loop_wakers.get(loop)
    if waker is None:
        with _loop_wakers_lock:
            # A new loop: release the eventfds of closed ones now, rather than when (or if) the
            # garbage collector frees them (asyncio.run per request would otherwise pile them up).
            for old in [old for old in _loop_wakers.keys() if old.is_closed()]:
                _loop_wakers.pop(old, None)
            waker = _loop_wakers[loop] = _LoopWaker(loop)
    return waker


async def _await_ready(waitable) -> None:
    """Suspends until waitable is ready: woken by the completion itself, no polling, no thread.
    One registration per (future, loop), however often the await is cancelled and retried
    (asyncio.wait_for with a timeout in a loop, say)."""
    handle = waitable._h
    if handle.is_ready():
        return
    loop = asyncio.get_running_loop()
    pending = getattr(waitable, "_pending", None)
    if pending is None or pending.get_loop() is not loop or pending.done():
        waker = _waker_for(loop)
        token, pending = waker.register(loop)
        handle.notify_when_ready(waker.notifier, token)
        waitable._pending = pending
    # Shielded: cancelling this await leaves the registration for the next one.
    await asyncio.shield(pending)

