#!/bin/sh
# Random secrets for compose.yaml, written once under deploy/compose/secrets/ (never committed;
# an existing file is kept, so rerunning is safe).
set -eu
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
mkdir -p "$dir"
chmod 700 "$dir"

random() { head -c 32 /dev/urandom | base64 | tr -d '/+=\n'; }

write() {
    if [ ! -f "$dir/$1" ]; then
        printf '%s\n' "$2" > "$dir/$1"
        # Read by the containers' own users through Compose's bind mount; the directory is 0700.
        chmod 644 "$dir/$1"
        echo "wrote $dir/$1"
    fi
}

write postgres-password "$(random)"
write database-url "postgresql+psycopg://specfleet:$(cat "$dir/postgres-password")@postgres:5432/specfleet"
write coordinator-broker-password "$(random)"
write verifier-broker-password "$(random)"
write secret-key "$(random)"
