"""The `specfleet` command line: the cloud side's entry point."""
