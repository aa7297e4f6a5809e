"""A network emulator of our own: a TCP proxy that adds latency, jitter, rate limits and drops."""

from netem.emulator import NetworkEmulator
from netem.profiles import PROFILES, LinkShape, Profile

__all__ = ["PROFILES", "LinkShape", "NetworkEmulator", "Profile"]
