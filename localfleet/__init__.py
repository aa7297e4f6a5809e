"""A whole fleet on one machine (broker, database, coordinator, verifiers and agents as separate
processes) and the demo that runs on it. A development and test harness, not the control plane."""
