"""What both model processes (the verifier's target, a device's draft) do with a child that is
lost: say why it ended, and kill and reap what is left of it."""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

STOP_TIMEOUT_S = 2.0


def exit_reason(process: BaseProcess) -> str:
    """Why the child ended ("was killed by SIGKILL ...", "exited with status 1"), after killing
    it if it lingers (its pipe broke, so it is of no use any more) and reaping it."""
    if process.is_alive():
        process.kill()
    process.join(STOP_TIMEOUT_S)
    code = process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        oom = " (the out-of-memory killer sends this)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{oom}"
    return f"exited with status {code}"


def kill_and_reap(process: BaseProcess | None, conn: Connection | None) -> None:
    """SIGKILL the child (if any), reap it and close its pipe."""
    if conn is not None:
        conn.close()
    if process is not None:
        if process.is_alive():
            process.kill()
        process.join(STOP_TIMEOUT_S)
        if process.exitcode is not None:
            process.close()
