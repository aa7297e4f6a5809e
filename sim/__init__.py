"""DSD-Sim: a discrete-event simulator of a specfleet fleet, calibrated on measured runs."""
