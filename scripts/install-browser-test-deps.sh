#!/usr/bin/env bash
# Headless Chromium (Debian's package) and Playwright for the dashboard's browser tests.
# Playwright drives the system browser through executable_path; `playwright install` is never
# run, since it downloads its own browsers.
set -euo pipefail

if [ -z "${PYTHON:-}" ]; then
    # The project's virtual environment when there is one, else whatever python3 is on PATH.
    repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [ -x "$repo_root/.venv/bin/python" ]; then
        PYTHON="$repo_root/.venv/bin/python"
    else
        PYTHON=python3
    fi
fi

if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        SUDO="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
fi

"$PYTHON" -m pip install --quiet "playwright>=1.44"

chromium --version
"$PYTHON" -c "import playwright; print('playwright', __import__('importlib.metadata').metadata.version('playwright'))"
