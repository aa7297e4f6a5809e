"""deploy/: the Kubernetes manifests against the Kubernetes API schemas (kubernetes-validate,
offline), the Compose file against the Compose specification (compose-spec), the Dockerfiles
against this repository, and the commands they run against the real CLI."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import compose_spec
import kubernetes_validate
import pytest
import tomllib
import yaml

from broker.mosquitto import free_port
from specfleet import cli

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE_FILE = DEPLOY / "compose" / "compose.yaml"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
KUBERNETES_VERSION = "1.37.0"
OVERLAY_SECRETS = (
    "database-url", "secret-key", "coordinator-broker-password", "verifier-broker-password",
)  # fmt: skip


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifest_files() -> list[Path]:
    return sorted(p for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_every_kubernetes_manifest_passes_the_api_schema_strictly(path: Path) -> None:
    documents = _documents(path)
    assert documents
    for document in documents:
        # Raises with the offending field; strict refuses fields the API does not know.
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_base_lists_every_manifest_and_only_those() -> None:
    kustomization = _documents(KUBERNETES / "base" / "kustomization.yaml")[0]
    listed = {KUBERNETES / "base" / name for name in kustomization["resources"]}
    assert listed == set((KUBERNETES / "base").glob("*.yaml")) - {
        KUBERNETES / "base" / "kustomization.yaml"
    }


def _workloads() -> dict[str, dict[str, Any]]:
    return {
        doc["metadata"]["name"]: doc
        for path in _manifest_files()
        for doc in _documents(path)
        if doc["kind"] == "Deployment"
    }


def test_verifiers_scale_and_every_container_has_probes_and_secrets_from_secrets() -> None:
    workloads = _workloads()
    assert workloads["coordinator"]["spec"]["replicas"] == 2  # sharing the fleet
    hpa = [
        doc
        for path in _manifest_files()
        for doc in _documents(path)
        if doc["kind"] == "HorizontalPodAutoscaler"
    ]
    assert [h["spec"]["scaleTargetRef"]["name"] for h in hpa] == ["verifier"]
    for name, workload in workloads.items():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            assert {"livenessProbe", "readinessProbe"} <= set(container), name
            for variable in container.get("env", []):
                secret_like = re.search(r"PASSWORD|SECRET|DATABASE_URL", variable["name"])
                if secret_like:
                    assert "secretKeyRef" in variable.get("valueFrom", {}), variable["name"]


def test_the_production_overlay_renders_and_its_output_validates(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    secrets_dir = copy / "overlays" / "production" / "secrets"
    secrets_dir.mkdir()
    for name in OVERLAY_SECRETS:
        (secrets_dir / name).write_text(f"test-{name}")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(copy / "overlays" / "production")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    documents = [doc for doc in yaml.safe_load_all(rendered) if doc is not None]
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    secret_names = {d["metadata"]["name"] for d in documents if d["kind"] == "Secret"}
    assert len(secret_names) == 1
    # Every reference follows the generated (content-hashed) name, in the same namespace.
    references = set(re.findall(r"(?:name|secretName): (specfleet-secrets\S*)", rendered))
    assert references == secret_names
    assert {d["metadata"].get("namespace") for d in documents if d["kind"] != "Namespace"} == {
        "specfleet"
    }


def _compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return document


def test_the_compose_file_passes_the_compose_specification() -> None:
    parsed = compose_spec.PyOptions(apply_merge=True).from_yaml(COMPOSE_FILE.read_text())
    assert parsed.validate() is None
    assert set(parsed.service_names()) == {
        "postgres", "broker-config", "mosquitto", "coordinator-a", "coordinator-b", "verifier",
    }  # fmt: skip


def test_compose_secrets_are_declared_and_made_by_make_secrets() -> None:
    compose = _compose()
    declared = compose["secrets"]
    made = set(
        re.findall(r"^write ([a-z-]+) ", (DEPLOY / "compose" / "make-secrets.sh").read_text(), re.M)
    )
    assert {Path(s["file"]).name for s in declared.values()} == made
    for name, service in compose["services"].items():
        for variable, value in (service.get("environment") or {}).items():
            if variable.endswith("_FILE") and str(value).startswith("/run/secrets/"):
                assert Path(value).name in service["secrets"], (name, variable)
        build = service.get("build")
        if build:
            assert (COMPOSE_FILE.parent / build["context"] / build["dockerfile"]).is_file()
    assert compose["services"]["verifier"]["deploy"]["replicas"] >= 2
    coordinators = [s for name, s in compose["services"].items() if name.startswith("coordinator")]
    assert len(coordinators) == 2
    ids = {c["environment"]["SPECFLEET_COORDINATOR_ID"] for c in coordinators}
    assert len(ids) == 2
    assert all(c["environment"]["SPECFLEET_SHARED_FLEET"] == "true" for c in coordinators)


def _service_command(command: str, broker_dir: Path, secret_files: dict[str, Path]) -> list[str]:
    """The shell command's `specfleet broker write-config` with paths moved under tmp."""
    text = command.replace("/broker", str(broker_dir))
    for name, path in secret_files.items():
        text = re.sub(rf"/(?:run/)?secrets/{name}\b", str(path), text)
    write = next(part for part in text.split("&&") if "write-config" in part)
    argv = shlex.split(write)
    assert argv[:3] == ["specfleet", "broker", "write-config"]
    return argv[1:]


def _image_env(dockerfile: str) -> dict[str, str]:
    """The ENV a Dockerfile's final stage sets (`ENV A=1 \\` continued lines)."""
    text = (DEPLOY / "docker" / dockerfile).read_text().replace("\\\n", " ")
    final = text.rsplit("\nFROM ", 1)[-1]
    return dict(re.findall(r"(SPECFLEET_[A-Z_]+)=(\S+)", " ".join(
        line for line in final.splitlines() if line.startswith("ENV ")
    )))  # fmt: skip


def _container_env(
    monkeypatch: pytest.MonkeyPatch, dockerfile: str, declared: dict[str, Any], tmp_path: Path
) -> None:
    """The process environment a container would get: the image's ENV, then the declared
    variables; secrets (NAME_FILE, secretKeyRef) stand in as a placeholder value."""
    for name in [n for n in os.environ if n.startswith("SPECFLEET_")]:
        monkeypatch.delenv(name)
    env = {**_image_env(dockerfile), **declared}
    for name, value in env.items():
        if name.endswith("_FILE"):
            name, value = name.removesuffix("_FILE"), "a-secret-value-of-32-characters!"
        elif isinstance(value, dict):  # valueFrom
            value = "a-secret-value-of-32-characters!"
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("SPECFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECFLEET_DATABASE_URL", raising=False)


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_the_broker_config_command_they_run_is_accepted_by_the_cli(
    where: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if where == "compose":
        service = _compose()["services"]["broker-config"]
        command = service["command"][2]
        declared = dict(service["environment"])
    else:
        init = _workloads()["broker"]["spec"]["template"]["spec"]["initContainers"][0]
        command = init["command"][2]
        declared = {e["name"]: e.get("value", e.get("valueFrom")) for e in init["env"]}
    _container_env(monkeypatch, "coordinator.Dockerfile", declared, tmp_path)
    secret_files = {}
    for name in ("coordinator_broker_password", "verifier_broker_password"):
        secret_files[name] = tmp_path / name
        secret_files[name.replace("_", "-")] = tmp_path / name
        (tmp_path / name).write_text(f"{name}-value\n")
    argv = _service_command(command, tmp_path / "broker", secret_files)
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))
    database = f"sqlite:///{tmp_path / 'specfleet.db'}"
    assert cli.main(["db", "upgrade", "--database-url", database]) == 0
    assert cli.main([*argv, "--database-url", database]) == 0, capsys.readouterr().err
    assert "new " not in capsys.readouterr().out  # both credentials came from the secrets
    assert (tmp_path / "broker" / "service-passwords").is_file()


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_the_verifier_probe_runs_in_the_verifier_container_environment(
    where: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The liveness probe's own command, in the container's environment, against a broker that
    is not there: it must build its settings and say so, not fail on them."""
    if where == "compose":
        declared = dict(_compose()["services"]["verifier"]["environment"])
    else:
        container = _workloads()["verifier"]["spec"]["template"]["spec"]["containers"][0]
        declared = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        liveness = container["livenessProbe"]["exec"]["command"][2]
        assert "--unreachable-ok" in liveness
    declared["SPECFLEET_BROKER_URL"] = f"mqtt://127.0.0.1:{free_port()}"
    _container_env(monkeypatch, "verifier.Dockerfile", declared, tmp_path)
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("specfleet.commands",))
    status = cli.main(["broker", "probe-verifier", "verifier-0", "--unreachable-ok"])
    assert status == 0, capsys.readouterr().err
    assert "broker unreachable, not judged" in capsys.readouterr().out


def _pyproject_extras(pyproject: Path = REPO_ROOT / "pyproject.toml") -> set[str]:
    with pyproject.open("rb") as handle:
        return set(tomllib.load(handle)["project"]["optional-dependencies"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_copy_what_exists_and_install_real_extras(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim", text, re.M)
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _destination = line.split()
        for source in sources:
            assert source == "." or (REPO_ROOT / source).exists(), source
    extras = set(re.findall(r"specfleet(?:_agent)?-\*\.whl\)\[([a-z-]+)\]", text))
    extras |= set(re.findall(r"^ARG EXTRA=([a-z-]+)", text, re.M))
    # The agent's image installs the agent's own wheel, whose extras are its runtimes.
    agent_wheel = "specfleet_agent-*.whl" in text
    pyproject = REPO_ROOT / (
        "deploy/agent-wheel/pyproject.toml" if agent_wheel else "pyproject.toml"
    )
    assert extras and extras <= {e for e in _pyproject_extras(pyproject) if "$" not in e}
    role = re.search(r'^CMD \["([a-z]+)"', text, re.M)
    assert role and f"    {role.group(1)})" in ENTRYPOINT.read_text()


def test_the_entrypoint_reads_secret_files_and_refuses_unreadable_ones(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_text("s3cret-value\n")
    shown = subprocess.run(
        ["sh", str(ENTRYPOINT), "sh", "-c", 'printf %s "$SPECFLEET_SECRET_KEY"'],
        env={"PATH": "/usr/bin:/bin", "SPECFLEET_SECRET_KEY_FILE": str(secret)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout == "s3cret-value"
    refused = subprocess.run(
        ["sh", str(ENTRYPOINT), "true"],
        env={"PATH": "/usr/bin:/bin", "SPECFLEET_BROKER_PASSWORD_FILE": str(tmp_path / "none")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 2
    assert "SPECFLEET_BROKER_PASSWORD_FILE" in refused.stderr
