"""Input files: valid ones load from TOML and JSON, a bad one is refused naming its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.inputs import Calibration, FleetSpec, SimInputError, SloSpec, WorkloadSpec, load

EXAMPLES = Path(__file__).resolve().parents[2] / "sim" / "examples"


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("pi-4g-fleet.toml", FleetSpec),
        ("scale-fleet.toml", FleetSpec),
        ("pi-4g-workload.toml", WorkloadSpec),
        ("scale-workload.toml", WorkloadSpec),
        ("slo-100ms.toml", SloSpec),
        ("scale-1k-fleet.toml", FleetSpec),
        ("scale-1k-workload.toml", WorkloadSpec),
        ("scale-1k-calibration.json", Calibration),
    ],
)
def test_the_shipped_examples_load(name: str, model: type) -> None:
    assert isinstance(load(EXAMPLES / name, model), model)


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (
            {"devices": [{"name": "pi", "count": 1, "link": {"profile": "5g"}}]},
            "devices.0.link.profile",
        ),
        ({"devices": [{"name": "pi", "count": 0}]}, "devices.0.count"),
        ({"devices": [{"name": "pi", "count": 1, "colour": "red"}]}, "devices.0.colour"),
        ({"devices": []}, "devices"),
        ({"devices": [{"name": "pi", "count": 1}], "broker": {"hop_ms": -1}}, "broker.hop_ms"),
    ],
)
def test_a_bad_fleet_is_refused_naming_the_field(
    tmp_path: Path, document: dict[str, object], field: str
) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(document))
    with pytest.raises(SimInputError) as caught:
        load(path, FleetSpec)
    message = str(caught.value)
    assert message.startswith(f"fleet.json: {field}:")
    assert "\n" not in message


def test_a_file_that_does_not_parse_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "workload.toml"
    path.write_text("sessions_per_s = = 3\n")
    with pytest.raises(SimInputError, match=r"^workload.toml: not valid toml") as caught:
        load(path, WorkloadSpec)
    assert "\n" not in str(caught.value)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SimInputError, match="cannot read"):
        load(tmp_path / "absent.toml", SloSpec)
