"""The coordinator: device registry, presence, sessions, scheduling, persistence and the admin API."""
