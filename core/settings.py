"""Settings of the cloud processes (coordinator, verifiers, the tools beside them); the only module
of theirs that reads the environment."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_HOME = Path.home() / ".local" / "share" / "specfleet"
# A TOML file of the settings (the environment's names, lower case, without the prefix:
# database_url = "..."), for hosts that keep their configuration in a file. The environment
# overrides the file, the file the defaults. `specfleet --config FILE` sets it.
CONFIG_ENV = "SPECFLEET_CONFIG"


class ConfigFileError(ValueError):
    """The settings file is missing, not TOML, or names a setting that does not exist."""


def config_file() -> Path | None:
    value = os.environ.get(CONFIG_ENV)
    return Path(value) if value else None


def use_config_file(path: Path | None) -> None:
    """Check the settings file named by `--config` (else by SPECFLEET_CONFIG, if set) and make it
    this process's, and its children's."""
    chosen = path or config_file()
    if chosen is None:
        return
    check_config_file(chosen)
    os.environ[CONFIG_ENV] = str(chosen.resolve())


def check_config_file(path: Path) -> None:
    """Refuse, with the reason, a file Settings would choke on or half ignore."""
    if not path.is_file():
        raise ConfigFileError(f"{path}: no such file")
    try:
        # pydantic-settings' own reader: tomllib, or tomli before Python 3.11.
        document = TomlConfigSettingsSource(Settings, path).toml_data
    except (OSError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        raise ConfigFileError(f"{path}: not TOML ({exc})") from None
    unknown = sorted(set(document) - set(Settings.model_fields))
    if unknown:
        raise ConfigFileError(f"{path}: no such setting: {', '.join(unknown)}")


class Settings(BaseSettings):
    """One per process; `SPECFLEET_*` environment variables override the defaults."""

    model_config = SettingsConfigDict(env_prefix="SPECFLEET_", env_file=None, extra="ignore")

    # "quickstart" is the embedded, single-machine mode: anonymous devices and built-in secrets
    # are accepted there only.
    environment: Literal["quickstart", "production"] = "quickstart"
    home: Path = DEFAULT_HOME
    database_url: str = ""
    broker_url: str = "mqtt://127.0.0.1:1883"
    broker_username: str | None = None
    broker_password: str | None = None
    # An external Mosquitto's files (`specfleet broker write-config --out DIR`) and how to reload
    # it (SIGHUP to the pid in the file, or a command): retiring a device through the API
    # rewrites them and reloads, which disconnects the device.
    broker_dir: Path | None = None
    broker_pid_file: Path | None = None
    broker_reload_command: str | None = None
    # The coordinator's MQTT client id; its persistent session keeps drafts queued across restarts.
    coordinator_id: str = "coordinator"
    # Several coordinators share this fleet (PostgreSQL only): each owns the devices of the shards
    # whose advisory locks it holds, and takes a dead peer's within seconds
    # (coordinator/runtime/shards.py).
    # Each needs its own coordinator_id (and broker account, on the devices' listener).
    shared_fleet: bool = False
    # "auto" tries MQTT 5 first; the embedded broker speaks 3.1.1 only.
    mqtt_protocol: Literal["auto", "5", "3.1.1"] = "auto"
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8420, ge=0, le=65535)
    # The API's base URL as devices reach it, for the artifacts they fetch (drafts on demand);
    # None: http://{http_host}:{http_port}/api/v1, which serves a host listening on 0.0.0.0 badly.
    artifact_base_url: str | None = Field(default=None, pattern=r"^https?://")
    models_dir: Path | None = None
    # The target by its model name in the models directory (`specfleet models build-target
    # --name`); None: SmolLM2-135M-Instruct. Verifiers load it; the coordinator reads its
    # identity (EOS, vocabulary) from the manifest there, where it has one.
    target: str | None = None
    # Presence: a device is offline after its Last Will, or after this many keepalives of silence.
    device_keepalive_s: int = Field(default=10, ge=1)
    # Quotas per device, so that one device (or one stolen credential) cannot starve the others.
    # An agent runs a handful of sessions at once; 32 leaves room for a busy gateway.
    device_max_open_sessions: int = Field(default=32, ge=1)
    # Prompt tokens (chat-templated) a session may open with; the target's context is 8,192.
    device_max_prompt_tokens: int = Field(default=4096, ge=1)
    # New sessions (and resumes of sessions not live here) per second, with a burst for an agent
    # that reconnects and resumes all its sessions at once; a resume of a live session is free.
    # 5/s leaves room for a device that serves a few short sessions at a time, back to back.
    device_session_opens_per_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    device_session_open_burst: int = Field(default=32, ge=1)
    # Telemetry messages per second; an agent sends one every few seconds.
    device_telemetry_per_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    device_telemetry_burst: int = Field(default=10, ge=1)
    # Status messages per second; an agent sends one as it connects, and when its drafts change.
    device_status_per_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    device_status_burst: int = Field(default=10, ge=1)
    # Devices whose latest telemetry waits to be written; past it, new devices' are dropped.
    telemetry_queue_size: int = Field(default=10_000, ge=1)
    # An active session that hears nothing (no draft, no round, no resume) for this long ends.
    session_idle_timeout_s: float = Field(default=1800.0, gt=0, allow_inf_nan=False)
    # A verifier offline this long is forgotten: dropped from the list, its retained status
    # cleared on the broker (verifiers with new ids each start would pile up there for good).
    verifier_forget_after_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    # A verifier's inference process appends one JSON line per forward pass here (its rows,
    # positions, prefills and time, on the host's monotonic clock): `verifier --pass-trace`.
    verifier_pass_trace: Path | None = None
    secret_key: str = ""
    # HTTP request bodies: the admin API's are small JSON; model release uploads get their own.
    http_max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    http_max_upload_bytes: int = Field(default=4 * 1024**3, ge=1024)
    # TLS for the HTTP API (uvicorn's own), or leave both empty behind a TLS proxy (deploy/).
    http_ssl_certfile: Path | None = None
    http_ssl_keyfile: Path | None = None
    # Bearer tokens stop working this long after they were issued.
    api_token_ttl_days: float = Field(default=90.0, gt=0, allow_inf_nan=False)
    # Dashboard logins: this many failures per client address or per token tried, within the
    # window, and further tries get 429 until the oldest failure leaves it.
    login_max_failures: int = Field(default=10, ge=1)
    login_window_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fill_defaults_and_refuse_weak_secrets(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.home / 'specfleet.db'}"
        if self.models_dir is None:
            self.models_dir = self.home / "models"
        if self.shared_fleet and not self.database_url.startswith("postgresql"):
            raise ValueError(
                "shared_fleet needs PostgreSQL: coordinators share a fleet through its "
                "advisory locks (SPECFLEET_DATABASE_URL=postgresql://...)"
            )
        if self.environment == "production" and len(self.secret_key) < 16:
            raise ValueError("SPECFLEET_SECRET_KEY must be set (16+ characters) in production")
        return self

    @property
    def resolved_models_dir(self) -> Path:
        assert self.models_dir is not None  # filled by the validator
        return self.models_dir

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = config_file()
        if path is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, path))


def get_settings() -> Settings:
    return Settings()
