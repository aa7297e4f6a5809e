"""A feature drafter in a session: its drafts ask for features, verdicts bring them, it drafts
from them; rounds verified by the real target's VerifierCore."""

from __future__ import annotations

import uuid
from dataclasses import replace

import numpy as np
import numpy.typing as npt
import pytest
from agent_peer import prompt_text

from broker import messages as m
from device_agent.drafting import SessionDrafter, SessionSpec
from inference.feature_head import HeadWeights, random_head_weights, step_reference
from inference.features import features_to_wire
from inference.onnx_runtime import OnnxRuntime
from inference.proposers import FeatureProposer, PromptLookupProposer, Proposer
from inference.sampling import SamplingParams
from inference.speculative import apply_stop_rules, decode_target
from inference.tokenizer import ChatTokenizer
from verifier.core import VerifierCore

F32 = npt.NDArray[np.float32]
MAX_TOKENS = 24
SAMPLED = m.SamplingSpec(temperature=0.8, top_p=0.95, seed=3)


class RandomHead:
    """An untrained head of the target's hidden size, stepped as the interface defines."""

    def __init__(self, weights: HeadWeights) -> None:
        assert weights.embed is not None
        self.weights, self.embed = weights, weights.embed
        self.name = weights.config.name
        self.hidden_size = weights.config.hidden_size
        self.vocab_ids = weights.vocab_ids

    def step(self, features: F32, tokens: npt.ArrayLike) -> tuple[F32, F32]:
        return step_reference(self.weights, self.embed, features, np.asarray(tokens))


@pytest.fixture(scope="module")
def head(target: tuple[OnnxRuntime, ChatTokenizer]) -> RandomHead:
    runtime, _ = target
    ids = np.arange(0, runtime.vocab_size, 7)
    weights = random_head_weights(
        runtime.hidden_size, ids, 5, vocab_size=runtime.vocab_size, intermediate_size=32
    )
    return RandomHead(weights)


def session(tokenizer: ChatTokenizer, proposer: Proposer, draft: str) -> SessionDrafter:
    text = prompt_text("code-01")
    spec = SessionSpec(
        session_id=uuid.uuid4().hex,
        prompt=text,
        prompt_ids=tuple(tokenizer.apply_chat_template(text)),
        task_type="test",
        sampling=m.SamplingSpec(),
        max_tokens=MAX_TOKENS,
        draft_model=draft,
        k=4,
    )
    return SessionDrafter(spec=spec, proposer=proposer, eos_id=tokenizer.eos_id, proactive=False)


def verify(core: VerifierCore, drafter: SessionDrafter, draft: m.Draft) -> m.Verdict:
    """The verifier's half of a round: VerifierCore, the stop rules, the verdict."""
    request = m.VerifyRequest(
        request_id=uuid.uuid4().hex,
        session_id=draft.session_id,
        round=draft.round,
        context_ids=tuple(drafter.committed),
        tokens=draft.tokens,
        want_features=draft.want_features,
    )
    (result,) = core.verify_batch([request])
    assert result.ok and result.next_token is not None
    kept, finished = apply_stop_rules(
        len(drafter.generated),
        list(draft.tokens[: result.n_accepted]),
        result.next_token,
        MAX_TOKENS,
        drafter.eos_id,
    )
    return m.Verdict(
        session_id=draft.session_id,
        round=draft.round,
        base_len=draft.base_len,
        n_accepted=len(kept) - 1,
        next_token=kept[-1],
        committed_len=draft.base_len + len(kept),
        finished=finished,
        features=None if finished else result.features,
    )


def test_a_feature_drafter_asks_gets_and_drafts_from_the_targets_features(
    target: tuple[OnnxRuntime, ChatTokenizer], head: RandomHead
) -> None:
    runtime, tokenizer = target
    proposer = FeatureProposer(head, fallback=PromptLookupProposer())
    drafter = session(tokenizer, proposer, "eagle-random")
    core = VerifierCore(runtime)
    drafts: list[m.Draft] = []
    while not drafter.finished:
        draft = drafter.draft().message(drafter.spec.session_id, 0.0)
        drafts.append(draft)
        verdict = verify(core, drafter, draft)
        assert (verdict.features is not None) == (not verdict.finished)
        drafter.apply_verdict(verdict)
    expected = decode_target(
        runtime, drafter.spec.prompt_ids, MAX_TOKENS, SamplingParams(), tokenizer.eos_id
    ).tokens
    assert drafter.generated == expected
    assert all(d.want_features for d in drafts)
    # Round 0 had no feature (the fallback drafted); every later round drafted with the head
    # (but the last, which may have no room left to draft).
    assert proposer.fallback_rounds == 1 and proposer.head_rounds >= len(drafts) - 2


def test_features_that_do_not_fit_the_head_are_refused_and_it_falls_back(
    target: tuple[OnnxRuntime, ChatTokenizer], head: RandomHead, caplog: pytest.LogCaptureFixture
) -> None:
    _, tokenizer = target
    proposer = FeatureProposer(head, fallback=PromptLookupProposer())
    drafter = session(tokenizer, proposer, "eagle-random")
    window = drafter.draft()
    verdict = m.Verdict(
        session_id=drafter.spec.session_id,
        round=0,
        base_len=window.base_len,
        n_accepted=0,
        next_token=13,
        committed_len=window.base_len + 1,
        features=features_to_wire(np.ones(head.hidden_size - 1, dtype=np.float32)),
    )
    drafter.apply_verdict(verdict)
    assert "features of a verdict refused" in caplog.text
    assert not proposer.has_features
    drafter.draft()
    assert proposer.head_rounds == 0 and proposer.fallback_rounds == 2


def test_drafters_that_do_not_ask_send_no_feature_bytes_and_cloud_rounds_ask_none(
    target: tuple[OnnxRuntime, ChatTokenizer], head: RandomHead
) -> None:
    _, tokenizer = target
    lookup = session(tokenizer, PromptLookupProposer(), "lookup")
    assert b"want_features" not in m.encode(lookup.draft().message("s", 0.0))
    drafter = session(tokenizer, FeatureProposer(head, PromptLookupProposer()), "eagle-random")
    drafter.mode = m.Mode.CLOUD
    cloud = drafter.draft().message("s", 0.0)
    assert cloud.cloud and cloud.want_features is None


@pytest.mark.parametrize(("sampling", "ahead"), [(m.SamplingSpec(), True), (SAMPLED, False)])
def test_a_feature_drafter_drafts_ahead_only_when_greedy(
    target: tuple[OnnxRuntime, ChatTokenizer],
    head: RandomHead,
    sampling: m.SamplingSpec,
    ahead: bool,
) -> None:
    """A window drafted ahead comes from the head's own predicted features; for a sampled session
    its use would depend on timing, so the session waits for the verdict's features."""
    _, tokenizer = target
    temperature = sampling.temperature
    proposer = FeatureProposer(head, PromptLookupProposer(), temperature=temperature)
    drafter = session(tokenizer, proposer, "eagle-random")
    drafter = SessionDrafter(
        spec=replace(drafter.spec, sampling=sampling),
        proposer=proposer,
        eos_id=tokenizer.eos_id,
        proactive=True,
    )
    proposer.give_features(np.ones(head.hidden_size, dtype=np.float32), len(drafter.committed))
    drafter.draft()
    assert drafter.speculate() is ahead


def test_local_mode_drafts_with_the_fallback(
    target: tuple[OnnxRuntime, ChatTokenizer], head: RandomHead
) -> None:
    """Offline there are no verdicts: the head's last feature is dropped and the fallback
    generates the provisional tail."""
    _, tokenizer = target
    proposer = FeatureProposer(head, fallback=PromptLookupProposer())
    drafter = session(tokenizer, proposer, "eagle-random")
    drafter.draft()
    proposer.give_features(np.ones(head.hidden_size, dtype=np.float32), len(drafter.committed))
    drafter.start_local()
    assert not proposer.has_features
    heads_before = proposer.head_rounds
    drafter.generate_locally(4)
    assert proposer.head_rounds == heads_before and proposer.fallback_rounds >= 2
