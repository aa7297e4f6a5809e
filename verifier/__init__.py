"""Verifier workers: the target model, per-session KV caches and batched verification."""
