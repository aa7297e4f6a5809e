"""The online runtime: the service on the bus, sessions and their rounds, the adaptive policy,
verifier leases, fleet presence, quotas, shards and metrics."""
