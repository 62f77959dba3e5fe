"""Exponential backoff for a remote tier: skip it after a failure, probe it once later."""

from __future__ import annotations

import random
import threading
import time


class Breaker:
    """Exponential backoff after a failed call; one probe call once it expires.

    States: closed (`failures == 0`, every call goes ahead), open (`now < until`,
    every call is skipped without touching the network), half-open (backoff
    expired: exactly one caller gets the probe ticket, the rest keep skipping).
    A failed probe doubles the backoff (capped, +-10% jitter so that engines
    sharing a Redis do not retry in lockstep); any success closes the breaker.
    A failure of a call admitted while closed opens the breaker but never
    escalates it, so a burst of in-flight calls failing together counts once.
    """

    SKIP, NORMAL, PROBE = 0, 1, 2

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._lock = threading.Lock()
        self.failures = 0
        self.until = 0.0
        self._probing = False

    def admit(self) -> int:
        with self._lock:
            if self.failures == 0:
                return self.NORMAL
            if self._probing or time.monotonic() < self.until:
                return self.SKIP
            self._probing = True
            return self.PROBE

    def is_open(self) -> bool:
        """True while calls would be skipped (no probe is due)."""
        with self._lock:
            return self.failures > 0 and (self._probing or time.monotonic() < self.until)

    def succeeded(self) -> None:
        with self._lock:
            self.failures = 0
            self._probing = False

    def failed(self, ticket: int) -> float:
        """Record a failure; returns the backoff now in force (s)."""
        with self._lock:
            if ticket == self.PROBE or self.failures == 0:
                self.failures += 1
                delay = min(self._initial_s * 2 ** (self.failures - 1), self._max_s)
                self.until = time.monotonic() + delay * random.uniform(0.9, 1.1)
            if ticket == self.PROBE:
                self._probing = False
            return max(0.0, self.until - time.monotonic())
