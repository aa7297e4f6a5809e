"""Benchmarks: each prints a table, writes JSON, and compares with its baseline in the same run."""
