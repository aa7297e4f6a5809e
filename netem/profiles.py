"""Named link profiles: latency, jitter and rate per direction, and whether the link is down.

Up is from the client (a device) to the upstream (the broker); down is the way back. Latency is
one-way, so a profile's round trip is up.latency_ms + down.latency_ms. The numbers:

- lan: switched gigabit Ethernet; a sub-millisecond round trip and no rate limit worth modelling.
- wifi: a home 802.11ac/ax network to a nearby broker; round trips of 5-20 ms with a few ms of
  jitter are typical, and the air, shared with other stations, caps a client near 50/20 Mbit/s.
- 4g: LTE medians reported by national regulators and crowd-sourced surveys (about 50-60 ms
  round trip, tens of Mbit/s down and a fraction of that up); we take 60 ms, 20/5 Mbit/s.
- congested: the "Slow 4G" of Lighthouse's throttling (150 ms round trip, 1.6 Mbit/s down,
  750 kbit/s up), the web's usual stand-in for a poor mobile link, with heavy jitter on top.
- offline: the link is cut; connections close and new ones are refused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkShape:
    """One direction of a link."""

    latency_ms: float = 0.0  # one-way delay added to every chunk
    jitter_ms: float = 0.0  # each chunk's delay varies uniformly within +- jitter_ms
    rate_kbit_s: float | None = None  # serialisation rate; None means unlimited

    def __post_init__(self) -> None:
        if self.latency_ms < 0 or self.jitter_ms < 0:
            raise ValueError("latency and jitter must be >= 0")
        if self.rate_kbit_s is not None and self.rate_kbit_s <= 0:
            raise ValueError("a rate limit must be > 0 kbit/s")


@dataclass(frozen=True)
class Profile:
    name: str
    up: LinkShape  # client -> upstream
    down: LinkShape  # upstream -> client
    offline: bool = False

    @property
    def rtt_ms(self) -> float:
        return self.up.latency_ms + self.down.latency_ms


PROFILES: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        Profile("lan", LinkShape(0.25, 0.05), LinkShape(0.25, 0.05)),
        Profile("wifi", LinkShape(5.0, 2.0, 20_000.0), LinkShape(5.0, 2.0, 50_000.0)),
        Profile("4g", LinkShape(30.0, 8.0, 5_000.0), LinkShape(30.0, 8.0, 20_000.0)),
        Profile("congested", LinkShape(75.0, 30.0, 750.0), LinkShape(75.0, 30.0, 1_638.4)),
        Profile("offline", LinkShape(), LinkShape(), offline=True),
    )
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise ValueError(f"unknown network profile {name!r}; known: {known}") from None
