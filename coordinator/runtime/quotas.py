"""Per-device quotas: what one device may ask of the coordinator, so none starves another."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.settings import Settings

# Rate limiters keep one bucket per device they heard from; a full bucket idle this long is
# forgotten (it would be full again anyway), and past this many devices the stalest goes first.
IDLE_BUCKET_S = 300.0
MAX_BUCKETS = 100_000


@dataclass(frozen=True)
class Quotas:
    """The limits of one device, from the settings."""

    max_open_sessions: int
    max_prompt_tokens: int
    session_opens_per_s: float
    session_open_burst: int
    telemetry_per_s: float
    telemetry_burst: int
    status_per_s: float
    status_burst: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Quotas:
        return cls(
            max_open_sessions=settings.device_max_open_sessions,
            max_prompt_tokens=settings.device_max_prompt_tokens,
            session_opens_per_s=settings.device_session_opens_per_s,
            session_open_burst=settings.device_session_open_burst,
            telemetry_per_s=settings.device_telemetry_per_s,
            telemetry_burst=settings.device_telemetry_burst,
            status_per_s=settings.device_status_per_s,
            status_burst=settings.device_status_burst,
        )


@dataclass
class TokenBucket:
    """`burst` tokens, refilled at `rate` per second; each admitted message takes one."""

    rate: float
    burst: int
    tokens: float
    updated: float

    def take(self, now: float) -> bool:
        self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def full_at(self, now: float) -> bool:
        return self.tokens + (now - self.updated) * self.rate >= self.burst


class RateLimiter:
    """A token bucket per key (a device id), in bounded memory."""

    def __init__(
        self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a rate limit needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def allow(self, key: str) -> bool:
        now = self._clock()
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst, float(self.burst), now)
        self._buckets[key] = bucket  # most recently used last
        allowed = bucket.take(now)
        self._prune(now)
        return allowed

    def __len__(self) -> int:
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        while len(self._buckets) > MAX_BUCKETS:
            self._buckets.popitem(last=False)
        while self._buckets:
            key, oldest = next(iter(self._buckets.items()))
            if now - oldest.updated < IDLE_BUCKET_S or not oldest.full_at(now):
                break
            del self._buckets[key]
