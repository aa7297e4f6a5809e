#!/usr/bin/env bash
# Run the test suite, after the set-up it needs (idempotent). Extra arguments go to pytest.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
bash scripts/setup.sh
for deps in scripts/install-browser-test-deps.sh scripts/install-flash-test-deps.sh; do
    if [ -f "$deps" ]; then
        PYTHON="$repo_root/.venv/bin/python" bash "$deps"
    fi
done
# The target and the drafts are built once into the models directory and reused (a second build
# is instant): the drafts from the committed weights in models/drafts/.
.venv/bin/specfleet models build-target
.venv/bin/specfleet models distill --export-only
exec .venv/bin/python -m pytest -q "$@"
