"""A verifier host loads its drafters' models ahead of their first cloud rounds.

`HostDrafters.preloads` names what a fresh host can load while no batch waits (the inference
process takes them one at a time between batches); `load` loads one and runs it once. A round
drafted after the loads is the round a host that loaded on first use drafts.
"""

from __future__ import annotations

import logging

import pytest
from verifier_helpers import cloud_request, prompt_ids

from inference.artifacts import default_models_dir
from inference.drafters import HYBRID, HYBRID_PREFIX, make_proposer
from inference.drafts import TFLITE_SUFFIX
from verifier.drafting import HostDrafters

DRAFTERS = ["hybrid", "hybrid+draft-l1", "hybrid+draft-l2", "draft-l1"]


def test_a_fresh_host_lists_the_table_then_every_model_onnx_first() -> None:
    host = HostDrafters(default_models_dir())
    preloads = host.preloads()
    models = [
        name
        for name in host.names
        if name not in (HYBRID, "lookup", "ngram") and not name.startswith(HYBRID_PREFIX)
    ]
    assert preloads[0] == HYBRID
    assert sorted(preloads[1:]) == sorted(models) and len(models) >= 2
    formats = [name.endswith(TFLITE_SUFFIX) for name in preloads[1:]]
    assert formats == sorted(formats)  # no LiteRT model before an ONNX one


def test_loaded_models_leave_the_list_and_draft_as_loaded_on_first_use() -> None:
    preloaded = HostDrafters(default_models_dir())
    for name in preloaded.preloads():
        assert preloaded.load(name) > 0.0
    assert preloaded.preloads() == []
    on_first_use = HostDrafters(default_models_dir())
    context = prompt_ids(3)
    for index, draft in enumerate(DRAFTERS):
        request = cloud_request(f"s-{index}", 0, context, draft, 6)
        assert preloaded.draft(request).tokens == on_first_use.draft(request).tokens, draft


def test_a_model_that_cannot_load_is_logged_and_the_rest_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = HostDrafters(default_models_dir())
    with caplog.at_level(logging.WARNING, logger="verifier.drafting"):
        host.load("draft-none")
    assert "could not load drafter draft-none" in caplog.text
    assert "draft-none" not in host.preloads()
    assert host.load(host.preloads()[-1]) > 0.0


def test_a_host_with_a_factory_of_its_own_loads_nothing_ahead() -> None:
    models = default_models_dir()
    host = HostDrafters(models, factory=lambda name, t: make_proposer(name, models))
    assert host.preloads() == []
