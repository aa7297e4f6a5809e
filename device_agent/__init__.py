"""The device agent: presence, telemetry and commands over the bus; drafting with local models."""

__version__ = "0.1.0"
