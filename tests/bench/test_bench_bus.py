"""`specfleet bench bus` shows its progress: a bar for each broker and setting it measures, left
on the terminal when done, and nothing else on stderr (two 'Task was destroyed' errors were).
Real brokers: a private Mosquitto and the embedded amqtt."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

COUNT, WARMUP = 20, 2


def test_every_configuration_has_a_finished_bar(tmp_path: Path) -> None:
    out = tmp_path / "bus.json"
    done = subprocess.run(
        [sys.executable, "-m", "specfleet", "bench", "bus", "--count", str(COUNT),
         "--warmup", str(WARMUP), "--embedded", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {row["broker"] for row in rows} == {"mosquitto (set_tcp_nodelay true)", "embedded amqtt"}
    # A bar redraws itself with carriage returns; its last state is what stays on the terminal.
    finished = [part.strip() for part in re.split(r"[\r\n]", done.stderr) if part.strip()]
    for row in rows:
        nodelay = "on" if row["tcp_nodelay"] else "off"
        label = f"{row['broker']}, TCP_NODELAY {nodelay}, features 0: 100%"
        total = f"{COUNT + WARMUP}/{COUNT + WARMUP}"
        assert any(line.startswith(label) and total in line for line in finished), (label, finished)
        assert row["count"] == COUNT
    assert all("%|" in line for line in finished), finished  # bars, and no log line between them
