"""The coordinator: device registry, presence, sessions, scheduling, persistence, admin API."""
