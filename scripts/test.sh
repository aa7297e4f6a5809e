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
# The tests distil small drafts and heads (a draft for a target the test writes, a head's
# training step), so they need the build extra's torch; only the tests and the model build
# import it, never a running role.
.venv/bin/python -m pip install --quiet 'torch==2.13.0'
# The target and the drafts are built once into the models directory and reused (a second build
# is instant): the drafts from the committed weights in models/drafts/, rebuilt only when those
# weights or the builder change (`models distill --export-only` would export them again, a minute).
.venv/bin/specfleet models build-target
.venv/bin/python -c 'from inference.artifacts import default_models_dir
from modelbuild.distill import ensure_drafts
from modelbuild.target_build import ensure_target
models_dir = default_models_dir()
ensure_drafts(models_dir, ensure_target(models_dir))'
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
# The whole suite, in two parts, so that it stays within about 20 minutes on 2 cores: the tests
# of one process or a few share both cores (pytest-xdist, each module on one worker; databases
# and the shared broker's lock are per worker, tests/conftest.py), then the end-to-end fleets,
# each of which starts a broker, a coordinator, verifiers and agents and keeps both cores busy by
# itself, one at a time. Both parts always run; the exit status is the first failure's.
status=0
.venv/bin/python -m pytest -q -n 2 --dist loadscope --ignore=tests/e2e || status=$?
.venv/bin/python -m pytest -q tests/e2e || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
