"""Feature heads on the verifier host: cloud rounds and plain stream rounds feed them the target's
own features, on the real target.

A random head built for the target (in a models directory of its own) shows where the feature
comes from: from a session's second cloud round on, the head's first drafted token is the one
it chains from the target-alone hidden state at the committed context's second-to-last token.
A context that does not extend the feature's (a rewind, a diverged resend) drafts without it.
The shipped `eagle-h1`, alone, then accepts drafted tokens of its own on a code prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from verifier_helpers import cloud_request, greedy_reference, make_request, prompt_ids

from broker.messages import StreamSpec
from inference.artifacts import default_models_dir
from inference.drafters import HYBRID_PREFIX, load_head
from inference.feature_head import random_head_weights
from inference.onnx_runtime import OnnxRuntime
from inference.proposers import FeatureHeadStep, FeatureProposer, feature_drafters
from inference.tokenizer import ChatTokenizer
from modelbuild.head_build import build_head, ensure_heads
from modelbuild.target_build import ensure_target
from verifier import drafting
from verifier.core import Verification, VerifierCore
from verifier.drafting import HostDrafters
from verifier.streams import HostStream

Target = tuple[OnnxRuntime, ChatTokenizer]
HEAD = "eagle-random"
SHIPPED = "eagle-h1"
K = 4
MAX_NEW = 16
STREAM_MAX_NEW = 32  # more than six rounds of a window of 4 can commit
# Batched kernels and a pass with a cache part from a target-alone pass in the last bits of a
# feature; a greedy step may then part from the expected one only where its best two logits tie.
NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def head_models(target: Target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target (linked) and an untrained head of its hidden size, in a directory of their own."""
    runtime, _ = target
    models = tmp_path_factory.mktemp("host-head")
    target_dir = ensure_target()
    (models / target_dir.name).symlink_to(target_dir, target_is_directory=True)
    ids = np.arange(0, runtime.vocab_size, 16)
    weights = random_head_weights(
        runtime.hidden_size, ids, 3, vocab_size=runtime.vocab_size, intermediate_size=64, name=HEAD
    )
    build_head(models, weights, models / target_dir.name)
    return models


def commit(v: Verification) -> list[int]:
    assert v.ok, v.error
    assert v.next_token is not None and v.features is None  # nothing for the bus
    return [*(v.draft_tokens or ())[: v.n_accepted], v.next_token]


def head_of(drafters: HostDrafters, draft: str, session: str) -> FeatureProposer:
    (head,) = feature_drafters(drafters.proposer(draft, 0.0, session))
    return head


def alone_hidden(runtime: OnnxRuntime, sequence: Sequence[int]) -> npt.NDArray[np.float32]:
    """The target's hidden states over `sequence`, in a pass of its own # [len, H]."""
    ((_, hidden),) = runtime.forward_batch_hidden([(list(sequence), runtime.new_cache())])
    return hidden


def assert_drafted_from(
    step: FeatureHeadStep, feature: npt.NDArray[np.float32], token: int, drafted: int
) -> None:
    """`drafted` is the head's greedy token after (feature, token), or the step's best two
    logits all but tie."""
    _, logits = step.step(feature.reshape(1, -1), [token])
    best = int(step.vocab_ids[int(logits[0].argmax())])
    if drafted != best:
        top_two = np.sort(logits[0])[-2:]
        assert top_two[1] - top_two[0] < NEAR_TIE, (drafted, best)


@pytest.mark.parametrize("draft", [HEAD, HYBRID_PREFIX + HEAD])
def test_cloud_rounds_draft_from_the_features_of_their_last_verdict(
    target: Target, head_models: Path, draft: str
) -> None:
    """Two sessions in one batch, as the target alone answers them; the head drafts from the
    feature that chose each round's last token, except in a session's first round."""
    runtime, tokenizer = target
    drafters = HostDrafters(head_models)
    core = VerifierCore(runtime, drafters=drafters)
    step = load_head(head_models, HEAD)
    prompts = (1, 9)
    generated: dict[int, list[int]] = {p: [] for p in prompts}
    rounds = {p: 0 for p in prompts}
    session = {p: f"{draft.replace('+', '-')}-{p}" for p in prompts}
    while active := [p for p in prompts if len(generated[p]) < MAX_NEW]:
        contexts = {p: [*prompt_ids(p), *generated[p]] for p in active}
        requests = [cloud_request(session[p], rounds[p], contexts[p], draft, K) for p in active]
        for p, v in zip(active, core.verify_batch(requests), strict=True):
            if draft == HEAD and rounds[p] > 0:  # alone, it always drafts its first token
                assert v.draft_tokens
                hidden = alone_hidden(runtime, contexts[p])
                assert_drafted_from(step, hidden[-2], contexts[p][-1], v.draft_tokens[0])
            # Handed to the head before it drafted, whichever tier of a hybrid proposed.
            assert head_of(drafters, draft, session[p]).has_features == (rounds[p] > 0)
            generated[p] += commit(v)
            rounds[p] += 1
    for p in prompts:
        assert generated[p][:MAX_NEW] == list(greedy_reference(p, MAX_NEW))
        assert tokenizer.eos_id not in generated[p][:MAX_NEW]  # every round was a full one
        assert drafters.wants_features(session[p])
        if draft == HEAD:
            head = head_of(drafters, draft, session[p])
            assert (head.fallback_rounds, head.head_rounds) == (1, rounds[p] - 1)


def test_plain_stream_rounds_hand_the_head_their_features(
    target: Target, head_models: Path
) -> None:
    """A stream of a head session whose passes chose k = 0: its next drafted round chains from
    the feature of the last plain round."""
    runtime, tokenizer = target
    drafters = HostDrafters(head_models)
    core = VerifierCore(runtime, drafters=drafters)
    step = load_head(head_models, HEAD)
    spec = StreamSpec(rounds=64, max_new=STREAM_MAX_NEW, eos_id=tokenizer.eos_id)
    opening = cloud_request("stream", 0, prompt_ids(3), HEAD, K).model_copy(update={"stream": spec})
    stream = HostStream.open(opening, received_at=0.0)
    for k in [K, 0, 0, K, 0, K]:
        request = stream.request(k)
        assert (request.cloud_draft is None) == (k == 0)
        head = head_of(drafters, HEAD, "stream") if request.round else None
        drafted_before = 0 if head is None else head.head_rounds
        (v,) = core.verify_batch([request])
        if k and head is not None:
            assert head.head_rounds == drafted_before + 1
            assert v.draft_tokens
            hidden = alone_hidden(runtime, stream.context)
            assert_drafted_from(step, hidden[-2], stream.context[-1], v.draft_tokens[0])
        tokens = commit(v)
        assert stream.advance(tuple(tokens[:-1]), v.n_accepted, tokens[-1])
    reference = greedy_reference(3, STREAM_MAX_NEW)
    assert stream.context == [*prompt_ids(3), *reference[: stream.generated]]
    assert head_of(drafters, HEAD, "stream").fallback_rounds == 1


@pytest.mark.parametrize(
    ("change", "head_drafts"),
    [("rewound", False), ("diverged", False), ("extended", True)],
)
def test_a_feature_drafts_only_a_context_that_extends_its_own(
    target: Target, head_models: Path, change: str, head_drafts: bool
) -> None:
    """After a verdict, the next round's context is cut back, changed before its end (same
    length), or carried on past the verdict (rounds committed elsewhere): the head drafts from
    the feature only in the last case, and every verdict stays the target's."""
    runtime, _ = target
    drafters = HostDrafters(head_models)
    core = VerifierCore(runtime, drafters=drafters)
    reference = greedy_reference(4, MAX_NEW)
    (first,) = core.verify_batch([cloud_request("s", 0, prompt_ids(4), HEAD, K)])
    committed = [*prompt_ids(4), *commit(first)]
    done = len(committed) - len(prompt_ids(4))
    if change == "rewound":
        context = committed[:-2]
    elif change == "diverged":
        context = [*committed[:-2], (committed[-2] + 1) % runtime.vocab_size, committed[-1]]
    else:
        context = [*committed, *reference[done : done + 3]]
    head = head_of(drafters, HEAD, "s")
    counts = (head.head_rounds, head.fallback_rounds)
    (second,) = core.verify_batch([cloud_request("s", 1, context, HEAD, K)])
    commit(second)
    assert (head.head_rounds, head.fallback_rounds) == (
        (counts[0] + 1, counts[1]) if head_drafts else (counts[0], counts[1] + 1)
    )
    assert second.draft_tokens is not None
    alone = make_request("alone", 1, context, second.draft_tokens)
    (verified,) = VerifierCore(runtime).verify_batch([alone])
    assert (verified.n_accepted, verified.next_token) == (second.n_accepted, second.next_token)


def test_a_sessions_feature_state_leaves_with_its_drafter(
    target: Target, head_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evicting a session's drafter or dropping the session forgets that it wants features; a
    session that drafts without a head never wanted them."""
    runtime, _ = target
    monkeypatch.setattr(drafting, "SESSION_PROPOSERS_KEPT", 2)
    drafters = HostDrafters(head_models)
    core = VerifierCore(runtime, drafters=drafters)
    drafters.proposer(HEAD, 0.0, "a")
    drafters.proposer("hybrid", 0.0, "copying")
    assert drafters.wants_features("a") and not drafters.wants_features("copying")
    drafters.proposer(HYBRID_PREFIX + HEAD, 0.0, "b")  # "a"'s, the least recent, goes
    assert not drafters.wants_features("a") and drafters.wants_features("b")
    core.drop("b")
    assert not drafters.wants_features("b")


@pytest.fixture(scope="module")
def shipped_head() -> Path:
    models = default_models_dir()
    assert SHIPPED in ensure_heads(models, ensure_target())
    return models


def test_the_shipped_head_alone_accepts_its_own_drafts_in_cloud_rounds(
    target: Target, shipped_head: Path
) -> None:
    """Before, a cloud session of `eagle-h1` drafted every round with its hybrid fallback; now
    only the first does, and the target accepts tokens the head drafted."""
    runtime, tokenizer = target
    drafters = HostDrafters(shipped_head)
    core = VerifierCore(runtime, drafters=drafters)
    prompt, max_new = 9, 48  # code: where the head is strongest
    generated: list[int] = []
    accepted_from_head = 0
    round_index = 0
    while len(generated) < max_new and tokenizer.eos_id not in generated:
        k = max(1, min(8, max_new - len(generated) - 1))
        head = head_of(drafters, SHIPPED, "shipped") if round_index else None
        drafted_before = 0 if head is None else head.head_rounds
        context = [*prompt_ids(prompt), *generated]
        (v,) = core.verify_batch([cloud_request("shipped", round_index, context, SHIPPED, k)])
        if head is not None and head.head_rounds > drafted_before:
            accepted_from_head += v.n_accepted
        generated += commit(v)
        round_index += 1
    reference = greedy_reference(prompt, max_new)
    assert generated[: len(reference)] == list(reference)
    head = head_of(drafters, SHIPPED, "shipped")
    assert (head.fallback_rounds, head.head_rounds) == (1, round_index - 1)
    assert accepted_from_head > 0


def test_a_passs_cloud_rounds_step_the_shipped_head_together_as_each_would_alone(
    target: Target, shipped_head: Path
) -> None:
    """Six sessions' cloud rounds of `hybrid+eagle-h1`, each with the target's feature for its
    context, drafted in one `draft_many` (one session twice: a resend, drafted after its first)
    and one by one on a host of their own: the same windows, and the head called once a step
    for all of them (ONNX Runtime gives a row in a batch what it gives it alone)."""
    runtime, _ = target
    draft = HYBRID_PREFIX + SHIPPED
    contexts = [list(prompt_ids(p)) for p in range(6)]
    requests = [cloud_request(f"s{i}", 1, c, draft, 6) for i, c in enumerate(contexts)]
    requests.append(cloud_request("s2", 2, contexts[2], draft, 3))  # s2 again

    def host() -> tuple[HostDrafters, list[int]]:
        drafters = HostDrafters(shipped_head)
        head = drafters._head(SHIPPED)
        rows: list[int] = []
        step = head.step

        def counted(features: npt.NDArray[np.float32], tokens: npt.ArrayLike) -> object:
            rows.append(features.shape[0])
            return step(features, tokens)

        head.step = counted  # type: ignore[method-assign]
        for request in requests:
            drafters.proposer(draft, 0.0, request.session_id)
            hidden = alone_hidden(runtime, request.context_ids)
            drafters.give_features(request.session_id, hidden[-2], request.context_ids)
        return drafters, rows

    together, rows_together = host()
    alone, rows_alone = host()
    windows = together.draft_many(requests)
    for request, window in zip(requests, windows, strict=True):
        assert not isinstance(window, Exception), window
        assert window.tokens == alone.draft(request).tokens, request.session_id
        assert window.draft_ms > 0.0
    assert any(window.tokens for window in windows if not isinstance(window, Exception))
    assert set(rows_alone) == {1}
    assert sum(rows_together) == len(rows_alone)
    assert len(rows_together) < len(rows_alone) and max(rows_together) >= 4
