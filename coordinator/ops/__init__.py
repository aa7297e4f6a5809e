"""Fleet operations: provisioning, flashing, packaging, releases, rollouts and `models deploy`."""
