"""Run the `specfleet` command line with `python -m specfleet`."""

from specfleet.cli import main

raise SystemExit(main())
