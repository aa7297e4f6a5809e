"""Device agent settings: the only agent module that reads the environment or a config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from broker.topics import validate_device_id

DEFAULT_HOME = Path.home() / ".local" / "share" / "specfleet-agent"


class AgentSettings(BaseSettings):
    """Command-line flags beat `SPECFLEET_*` environment variables, which beat the config file."""

    model_config = SettingsConfigDict(env_prefix="SPECFLEET_", extra="ignore")

    device_id: str
    credential: str | None = None  # absent only for anonymous quickstart brokers
    broker_url: str = "mqtt://127.0.0.1:1883"
    ca_file: Path | None = None  # CA bundle for mqtts:// brokers
    kind: str = "other"
    keepalive_s: int = Field(default=10, ge=1, le=3600)
    telemetry_interval_s: float = Field(default=5.0, gt=0)
    mqtt_protocol: str = Field(default="auto", pattern=r"^(auto|5|3\.1\.1)$")
    home: Path = DEFAULT_HOME
    models_dir: Path | None = None

    @field_validator("device_id")
    @classmethod
    def _device_id_is_a_topic_level(cls, value: str) -> str:
        return validate_device_id(value)

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


def load_agent_settings(config_file: Path | None = None, **overrides: Any) -> AgentSettings:
    """Build the settings from flags (`overrides`, None meaning unset), environment and file."""
    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")

    class FromFile(AgentSettings):
        model_config = SettingsConfigDict(
            env_prefix="SPECFLEET_", extra="ignore", toml_file=config_file
        )

    return FromFile(**{k: v for k, v in overrides.items() if v is not None})
