"""Device agent settings: the only agent module that reads the environment or a config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from broker.topics import validate_device_id

DEFAULT_HOME = Path.home() / ".local" / "share" / "specfleet-agent"
# Beside the coordinator's HTTP port (8420), on loopback only.
DEFAULT_LOCAL_API_PORT = 8421

DraftRuntime = Literal["onnx", "tflite"]


class LocalSettings(BaseSettings):
    """What the device needs without the bus: models, drafting defaults, the local API.

    `specfleet-agent ask` reads these alone to find a running agent, so they need no device id.
    Command-line flags beat `SPECFLEET_*` environment variables, which beat the config file.
    """

    model_config = SettingsConfigDict(env_prefix="SPECFLEET_", extra="ignore")

    home: Path = DEFAULT_HOME
    models_dir: Path | None = None  # default: <home>/models
    # Where tokenizer.json and chat_format.json live; default: the first model under models_dir
    # that carries them (every draft and target directory does).
    tokenizer_dir: Path | None = None
    # The target this device drafts for, by its model name: its tokenizer is read from that
    # target's directory, or from a draft built for it; None: SmolLM2, or whatever is there.
    target: str | None = Field(default=None, min_length=1, max_length=128)
    default_draft: str = Field(default="lookup", min_length=1, max_length=128)
    draft_runtime: DraftRuntime = "onnx"  # which build of a neural draft a bare name means
    default_k: int | None = Field(default=None, ge=0, le=64)  # None: the drafter's own default
    default_max_tokens: int = Field(default=128, ge=1, le=8192)
    draft_threads: int | None = Field(default=None, ge=1, le=64)
    # Draft the next window while a verdict is in flight (switchable for the benchmark).
    proactive: bool = True
    local_api: bool = True
    local_api_port: int = Field(default=DEFAULT_LOCAL_API_PORT, ge=0, le=65535)  # 0: any free
    # A round with no verdict after this long re-sends its draft (rounds are idempotent).
    round_timeout_s: float = Field(default=10.0, gt=0)
    round_retries: int = Field(default=6, ge=0, le=1000)
    # A session that has heard nothing from the coordinator for this long (its link down, or
    # no verdict) generates with its drafter alone and marks the text provisional; 0: never.
    fallback_after_s: float = Field(default=5.0, ge=0)
    # Keep open sessions in <home>/agent-journal.sqlite3, so that a restarted agent resumes them.
    journal: bool = True
    # Run each neural draft in a supervised child process (issue 17): a native crash, a hang or
    # an OOM kill there costs a round's draft, not the agent. False: in this process.
    isolate_drafts: bool = True

    @property
    def resolved_models_dir(self) -> Path:
        return self.models_dir if self.models_dir is not None else self.home / "models"

    @property
    def journal_path(self) -> Path:
        return self.home / "agent-journal.sqlite3"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


class AgentSettings(LocalSettings):
    """Everything `specfleet-agent run` needs: the local settings plus identity and the bus."""

    device_id: str
    credential: str | None = None  # absent only for anonymous quickstart brokers
    credential_file: Path | None = None  # read when `credential` is not given (bundles use it)
    broker_url: str = "mqtt://127.0.0.1:1883"
    ca_file: Path | None = None  # CA bundle for mqtts:// brokers
    kind: str = "other"
    keepalive_s: int = Field(default=10, ge=1, le=3600)
    telemetry_interval_s: float = Field(default=5.0, gt=0)
    mqtt_protocol: str = Field(default="auto", pattern=r"^(auto|5|3\.1\.1)$")
    # A new local session waits this long for a reconnecting bus before it is refused.
    connect_wait_s: float = Field(default=15.0, ge=0, le=3600)
    # The coordinator's Ed25519 public key (PEM): model releases must carry its signature.
    release_key_file: Path | None = None
    # An HTTP proxy for artifact downloads (a site's caching proxy); the environment's is not used.
    http_proxy: str | None = None
    # Heat and power, reported with the telemetry: past a limit the coordinator keeps drafting
    # off this device (to the verifier host, or to its cheapest drafter). power_saver is the
    # user's own switch. /sys is read under sys_root (a container may mount the host's elsewhere).
    thermal_limit_c: float = Field(default=80.0, gt=0, le=200)
    battery_floor_percent: float = Field(default=20.0, ge=0, le=100)
    power_saver: bool = False
    sys_root: Path = Path("/sys")
    # Memory admission: a neural draft is loaded only when its estimated resident cost plus
    # this margin fits MemAvailable (or the room under the agent's cgroup v2 memory.max).
    # /proc is read under proc_root, as /sys under sys_root.
    memory_margin_mb: float = Field(default=64.0, ge=0, le=1024 * 1024)
    proc_root: Path = Path("/proc")

    @field_validator("device_id")
    @classmethod
    def _device_id_is_a_topic_level(cls, value: str) -> str:
        return validate_device_id(value)

    @model_validator(mode="after")
    def _read_credential_file(self) -> AgentSettings:
        if self.credential is None and self.credential_file is not None:
            self.credential = self.credential_file.read_text().strip() or None
        return self


S = TypeVar("S", bound=LocalSettings)


def _load(cls: type[S], config_file: Path | None, overrides: dict[str, Any]) -> S:
    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")

    class FromFile(cls):  # type: ignore[valid-type,misc]
        model_config = SettingsConfigDict(
            env_prefix="SPECFLEET_", extra="ignore", toml_file=config_file
        )

    loaded: S = FromFile(**{k: v for k, v in overrides.items() if v is not None})
    return loaded


def load_agent_settings(config_file: Path | None = None, **overrides: Any) -> AgentSettings:
    """Build the settings from flags (`overrides`, None meaning unset), environment and file."""
    return _load(AgentSettings, config_file, overrides)


def load_local_settings(config_file: Path | None = None, **overrides: Any) -> LocalSettings:
    """The device-local part of the settings, from the same sources; no device id needed."""
    return _load(LocalSettings, config_file, overrides)
