"""The kernel every process shares, and that imports nothing else of ours.

What is here: the shared exceptions (`errors`), the settings of the cloud processes
(`settings`), table and JSON report output (`report`), the asyncio pieces that run on
Python 3.10 as on 3.11+ (`aio`), and what both command lines share (`logs`, `cli_help`,
`completion`). Every other package may import it; it imports only the standard library and the
base dependencies (pydantic). The layer rule is in pyproject.toml ([tool.importlinter]).

Named `core` rather than `kernel` or `common`: in a project that runs models, a "kernel" is a
compute kernel, and "common" says nothing about the direction of imports; `core` is the bottom
layer, the part the others are built on.
"""
