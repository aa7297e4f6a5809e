#!/bin/sh
# The images' entrypoint: secrets from files, then the role.
#
# Compose secrets and mounted Kubernetes Secrets are files; for each NAME below, NAME_FILE
# (a path) becomes NAME (its contents), so no secret has to sit in the environment of the
# orchestrator's own records. The role is the first argument; anything else runs as given.
set -eu

for name in SPECFLEET_BROKER_PASSWORD SPECFLEET_SECRET_KEY SPECFLEET_DATABASE_URL; do
    eval "path=\${${name}_FILE:-}"
    if [ -n "$path" ]; then
        if [ ! -r "$path" ]; then
            echo "entrypoint: ${name}_FILE=$path is not readable" >&2
            exit 2
        fi
        value="$(cat "$path")"
        export "$name=$value"
    fi
done

role="${1:-}"
case "$role" in
    coordinator)
        # Migrates the database to head, then serves the coordinator and its HTTP API.
        exec specfleet up --broker "${SPECFLEET_BROKER_URL:?set SPECFLEET_BROKER_URL}"
        ;;
    verifier)
        shift
        # The pod's or container's host name is unique among replicas: it names the verifier.
        exec specfleet verifier --id "${SPECFLEET_VERIFIER_ID:-$(hostname)}" "$@"
        ;;
    agent)
        shift
        exec specfleet-agent run --config "${SPECFLEET_AGENT_CONFIG:-/bundle/agent.toml}" "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
