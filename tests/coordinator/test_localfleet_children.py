"""A local fleet's child processes (verifiers, agents, a coordinator) end with the process that
started them, even when it is killed with SIGKILL: each is sent SIGTERM, as on Ctrl-C, instead
of running on with nobody to stop it. Real processes, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.processes import alive

GONE_S = 5.0

# Starts a child the way a local fleet does (its own session, its output to a log), says its
# pid, and sleeps. The child records the signal that ends it.
OWNER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from localfleet.fleet import ChildProcess

    out = Path(sys.argv[1])
    child = ChildProcess(
        "sleeper",
        [sys.executable, "-c",
         "import signal, sys, time\\n"
         "def bye(signum, frame):\\n"
         "    print('stopped by', signal.Signals(signum).name, flush=True)\\n"
         "    sys.exit(0)\\n"
         "signal.signal(signal.SIGTERM, bye)\\n"
         "print('ready', flush=True)\\n"
         "time.sleep(600)\\n"],
        dict(os.environ),
        out / "sleeper.log",
    )
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
def test_a_sigkilled_owner_s_child_is_stopped_as_on_ctrl_c(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    child = 0
    log = tmp_path / "sleeper.log"
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        deadline = time.monotonic() + 30
        while "ready" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and alive(child), "the child did not start"
            time.sleep(0.05)
        assert os.getsid(child) == child  # a session of its own, as before

        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + GONE_S
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the child outlived its SIGKILLed owner"
        assert "stopped by SIGTERM" in log.read_text()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)
