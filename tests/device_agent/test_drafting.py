"""Drafting rounds against the real target: windows, verdicts, resync, proactive drafts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from agent_peer import TargetJudge, prompt_text, reference

from broker import messages as m
from device_agent import drafting
from device_agent.catalog import DrafterCatalog
from device_agent.drafting import OutOfSync, SessionDrafter, SessionSpec
from device_agent.settings import DraftRuntime
from inference.onnx_runtime import OnnxRuntime
from inference.tokenizer import ChatTokenizer

GREEDY = m.SamplingSpec()
SAMPLED = m.SamplingSpec(temperature=0.8, top_p=0.95, seed=11)
MAX_TOKENS = 40


def make_drafter(
    tokenizer: ChatTokenizer,
    catalog: DrafterCatalog,
    prompt_id: str,
    *,
    draft: str = "lookup",
    k: int = 4,
    sampling: m.SamplingSpec = GREEDY,
    proactive: bool = True,
    max_tokens: int = MAX_TOKENS,
) -> SessionDrafter:
    text = prompt_text(prompt_id)
    spec = SessionSpec(
        session_id=f"t-{prompt_id}",
        prompt=text,
        prompt_ids=tuple(tokenizer.apply_chat_template(text)),
        task_type="test",
        sampling=sampling,
        max_tokens=max_tokens,
        draft_model=draft,
        k=k,
    )

    def swap(old: object, name: str) -> object | None:
        return catalog.acquire(name, sampling.temperature) if catalog.has(name) else None

    return SessionDrafter(
        spec=spec,
        proposer=catalog.acquire(draft, sampling.temperature),
        eos_id=tokenizer.eos_id,
        proactive=proactive,
        swap_proposer=swap,  # type: ignore[arg-type]
    )


def run_rounds(drafter: SessionDrafter, judge: TargetJudge) -> list[m.Draft]:
    """Open, then round after round as the agent does, proactive drafts included."""
    drafter.resync(judge.open(drafter.spec.open_message()))
    sent: list[m.Draft] = []
    while not drafter.finished:
        draft = drafter.draft().message(drafter.spec.session_id, 0.0)
        sent.append(draft)
        drafter.speculate()  # the agent does this while the verdict is in flight
        answer = judge.judge(draft)
        assert isinstance(answer, m.Verdict), answer
        assert drafter.apply_verdict(answer) is not None
    return sent


@pytest.mark.parametrize("proactive", [False, True])
@pytest.mark.parametrize("prompt_id", ["code-01", "summarize-01"])
def test_greedy_rounds_give_the_target_s_own_tokens(
    target: tuple[OnnxRuntime, ChatTokenizer],
    catalog: DrafterCatalog,
    prompt_id: str,
    proactive: bool,
) -> None:
    runtime, tokenizer = target
    drafter = make_drafter(tokenizer, catalog, prompt_id, proactive=proactive)
    sent = run_rounds(drafter, TargetJudge(runtime, tokenizer.eos_id))
    assert drafter.generated == reference(prompt_id, target, MAX_TOKENS)
    assert all(d.q_ids is None and d.q_probs is None for d in sent)  # greedy sends no q'
    assert [d.round for d in sent] == list(range(len(sent)))
    # Every window fits what is left of max_tokens, the target's token included.
    for draft in sent:
        assert len(draft.tokens) <= MAX_TOKENS - (draft.base_len - drafter.prompt_len) - 1


def test_proactive_windows_are_the_ones_drafting_after_the_verdict_would_send(
    target: tuple[OnnxRuntime, ChatTokenizer],
    catalog: DrafterCatalog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every round drafts ahead, whatever the hit rate and the (machine-dependent) cost.
    monkeypatch.setattr(drafting, "PROACTIVE_MIN_HIT_RATE", 0.0)
    runtime, tokenizer = target
    runs = {}
    for proactive in (False, True):
        drafter = make_drafter(tokenizer, catalog, "summarize-01", proactive=proactive)
        sent = run_rounds(drafter, TargetJudge(runtime, tokenizer.eos_id))
        runs[proactive] = (drafter, [(d.round, d.base_len, d.tokens) for d in sent])
    (plain, plain_sent), (eager, eager_sent) = runs[False], runs[True]
    assert eager_sent == plain_sent
    assert plain.stats.hits == plain.stats.misses == 0
    # Copying from a summarised passage often gets a whole window and the bonus token right.
    assert eager.stats.hits > 0
    hits = [r for r in eager.records if r.proactive_window]
    assert len(hits) == eager.stats.hits
    predrafted = [r for r in eager.records if r.predraft != "none"]
    assert eager.stats.hits + eager.stats.misses == len(predrafted)
    for record in eager.records:
        # A pre-drafted window was confirmed exactly when the whole window was accepted.
        if record.predraft == "hit":
            assert record.accepted == record.drafted


@pytest.mark.parametrize("draft", ["lookup", "draft-l1", "draft-l1-tflite"])
def test_sampled_rounds_are_reproducible_and_send_q(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog, draft: str
) -> None:
    if not catalog.has(draft):
        pytest.skip(f"{draft} is not built in {catalog.models_dir}")
    runtime, tokenizer = target
    outputs = []
    for proactive in (False, True):
        drafter = make_drafter(
            tokenizer,
            catalog,
            "chat-01",
            draft=draft,
            sampling=SAMPLED,
            proactive=proactive,
            max_tokens=16,
        )
        sent = run_rounds(drafter, TargetJudge(runtime, tokenizer.eos_id))
        outputs.append((drafter.generated, [d.tokens for d in sent]))
        for message in sent:
            assert (message.q_ids is None) == (len(message.tokens) == 0)
            if message.q_ids is not None and message.q_probs is not None:
                assert len(message.q_ids) == len(message.tokens)
                for token, ids, probs in zip(
                    message.tokens, message.q_ids, message.q_probs, strict=True
                ):
                    assert token in ids  # the draft sampled from the q' it sends
                    assert probs[ids.index(token)] > 0
    # The draft draws from round_rng(seed, round), so drafting ahead changes nothing.
    assert outputs[0] == outputs[1]
    assert len(outputs[0][0]) > 0


def test_policy_in_a_verdict_changes_window_and_drafter(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    runtime, tokenizer = target

    def policy(round_index: int) -> m.Policy | None:
        if round_index == 2:
            return m.Policy(draft_model="hybrid", k=6)
        if round_index == 5:
            return m.Policy(draft_model="not-on-this-device", k=1)
        return None

    drafter = make_drafter(tokenizer, catalog, "code-01", k=3)
    sent = run_rounds(drafter, TargetJudge(runtime, tokenizer.eos_id, policy))
    assert drafter.generated == reference("code-01", target, MAX_TOKENS)
    assert {d.draft_model for d in sent[:3]} == {"lookup"}
    assert all(len(d.tokens) <= 3 for d in sent[:3])
    # From round 3 on: hybrid; after round 5 k is 1 and the unknown drafter is refused.
    assert all(d.draft_model == "hybrid" for d in sent[3:])
    assert all(len(d.tokens) <= 6 for d in sent[3:6])
    assert all(len(d.tokens) <= 1 for d in sent[6:])


def test_resync_takes_the_coordinator_s_truth(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    runtime, tokenizer = target
    judge = TargetJudge(runtime, tokenizer.eos_id)
    ahead = make_drafter(tokenizer, catalog, "chat-01")
    ahead.resync(judge.open(ahead.spec.open_message()))
    for _ in range(3):
        draft = ahead.draft().message(ahead.spec.session_id, 0.0)
        verdict = judge.judge(draft)
        assert isinstance(verdict, m.Verdict)
        ahead.apply_verdict(verdict)

    # A second agent process resuming the same session: the state brings it up to date.
    behind = make_drafter(tokenizer, catalog, "chat-01")
    state = judge.open(behind.spec.open_message())
    outcome = behind.resync(state)
    assert not outcome.in_sync and not outcome.rewound
    assert outcome.new_tokens == ahead.generated
    assert behind.committed == ahead.committed and behind.round == 3
    assert behind.resync(state).in_sync

    # Its next draft is the one the protocol expects, and the judge accepts it.
    draft = behind.draft().message(behind.spec.session_id, 0.0)
    assert (draft.round, draft.base_len) == (3, len(ahead.committed))
    verdict = judge.judge(draft)
    assert isinstance(verdict, m.Verdict)
    # The stored verdict of an earlier round is stale; a verdict of a round not sent is not.
    assert behind.apply_verdict(judge.sessions[behind.spec.session_id].verdicts[0]) is None
    with pytest.raises(OutOfSync):
        behind.apply_verdict(verdict.model_copy(update={"round": 9}))
    assert behind.apply_verdict(verdict) is not None
    assert behind.round == 4


def test_a_state_that_drops_committed_tokens_rewinds(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    runtime, tokenizer = target
    judge = TargetJudge(runtime, tokenizer.eos_id)
    drafter = make_drafter(tokenizer, catalog, "chat-01")
    drafter.resync(judge.open(drafter.spec.open_message()))
    verdict = judge.judge(drafter.draft().message(drafter.spec.session_id, 0.0))
    assert isinstance(verdict, m.Verdict)
    drafter.apply_verdict(verdict)
    outcome = drafter.resync(
        m.SessionState(
            session_id=drafter.spec.session_id,
            prompt_len=drafter.prompt_len,
            generated_ids=(),
            next_round=0,
            status="active",
        )
    )
    assert outcome.rewound and outcome.new_tokens == []
    assert drafter.generated == [] and drafter.round == 0


@pytest.mark.parametrize("status", ["finished", "cancelled", "failed"])
def test_a_state_that_is_not_active_ends_the_session(
    tokenizer: ChatTokenizer, catalog: DrafterCatalog, status: str
) -> None:
    drafter = make_drafter(tokenizer, catalog, "chat-01")
    drafter.resync(
        m.SessionState(
            session_id=drafter.spec.session_id,
            prompt_len=drafter.prompt_len,
            generated_ids=(5, 6),
            next_round=1,
            status=status,
        )
    )
    assert drafter.finished and drafter.status == status
    assert drafter.generated == [5, 6]


def test_drafting_ahead_pauses_while_it_keeps_missing() -> None:
    stats = drafting.ProactiveStats()
    stats.record_cost(5.0)  # a neural draft's window
    tries = []
    for _ in range(5):
        tries.append(stats.should_try())
        stats.record(hit=False)
    assert tries == [True] * 5 and stats.recent < drafting.PROACTIVE_MIN_HIT_RATE
    # Paused: it skips, then probes once every PROACTIVE_PROBE_EVERY rounds.
    decisions = [stats.should_try() for _ in range(drafting.PROACTIVE_PROBE_EVERY)]
    assert decisions == [False] * (drafting.PROACTIVE_PROBE_EVERY - 1) + [True]
    assert stats.skipped == drafting.PROACTIVE_PROBE_EVERY - 1
    # A probe that hits brings drafting ahead back.
    stats.record(hit=True)
    assert stats.should_try() and (stats.hits, stats.misses) == (1, 5)


def test_a_draft_that_keeps_missing_stops_drafting_ahead(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    runtime, tokenizer = target
    # The distilled draft-l1 rarely gets a whole window right, so its windows drafted ahead
    # are wasted; the session stops drafting them and the output stays the target's.
    if not catalog.has("draft-l1"):
        pytest.skip("draft-l1 is not built")
    drafter = make_drafter(tokenizer, catalog, "chat-01", draft="draft-l1", max_tokens=32)
    run_rounds(drafter, TargetJudge(runtime, tokenizer.eos_id))
    assert drafter.generated == reference("chat-01", target, 32)
    stats = drafter.stats
    assert stats.skipped > 0
    assert stats.hits + stats.misses + stats.skipped <= len(drafter.records)
    assert stats.cost_ms >= drafting.PROACTIVE_FREE_MS


def test_drafting_ahead_that_costs_nothing_never_pauses() -> None:
    stats = drafting.ProactiveStats()
    stats.record_cost(0.05)  # a lookup window
    for _ in range(20):
        stats.record(hit=False)
    assert stats.should_try() and stats.skipped == 0


@pytest.mark.parametrize("draft", ["draft-l1", "draft-l1-tflite", "hybrid+draft-l1"])
def test_greedy_rounds_with_neural_drafts_give_the_target_s_own_tokens(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog, draft: str
) -> None:
    if not catalog.has(draft):
        pytest.skip(f"{draft} is not built in {catalog.models_dir}")
    runtime, tokenizer = target
    drafter = make_drafter(tokenizer, catalog, "code-01", draft=draft, max_tokens=16)
    sent = run_rounds(drafter, TargetJudge(runtime, tokenizer.eos_id))
    assert drafter.generated == reference("code-01", target, 16)
    assert {d.draft_model for d in sent} == {draft}


@pytest.mark.parametrize(
    ("runtime", "name", "resolved"),
    [
        ("onnx", "draft-l1", "draft-l1"),
        ("tflite", "draft-l1", "draft-l1-tflite"),
        ("onnx", "draft-l1-tflite", "draft-l1-tflite"),
        ("tflite", "hybrid+draft-l1", "hybrid+draft-l1-tflite"),
        ("tflite", "lookup", "lookup"),
    ],
)
def test_a_bare_draft_name_means_the_preferred_runtime(
    models_dir: Path, runtime: DraftRuntime, name: str, resolved: str
) -> None:
    catalog = DrafterCatalog(models_dir, runtime=runtime)
    if not catalog.has("draft-l1-tflite") or not catalog.has("draft-l1"):
        pytest.skip("needs both builds of draft-l1")
    assert catalog.resolve(name) == resolved
    assert catalog.has(name)
    assert not catalog.has("draft-l9")


def test_cloud_rounds_carry_no_tokens_and_commit_the_hosts_draft(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    """A cloud window is a request; its verdict brings the draft, and a stream keeps it going."""
    _, tokenizer = target
    answer = reference("code-01", target, MAX_TOKENS)
    base = make_drafter(tokenizer, catalog, "code-01", draft="hybrid", k=4)
    drafter = SessionDrafter(
        spec=replace(base.spec, mode=m.Mode.CLOUD),
        proposer=base.proposer,
        eos_id=tokenizer.eos_id,
    )
    assert drafter.spec.open_message().mode is m.Mode.CLOUD
    prompt_len = len(drafter.spec.prompt_ids)
    window = drafter.draft()
    draft = window.message(drafter.spec.session_id, 0.0)
    assert draft.cloud and draft.tokens == () and draft.cloud_k == 4
    assert not drafter.speculate()  # nothing to draft ahead: the host drafts

    def cloud_verdict(round_index: int, start: int, n: int, **fields: object) -> m.Verdict:
        hosted = tuple(answer[start : start + 4])
        return m.Verdict(
            session_id=drafter.spec.session_id,
            round=round_index,
            base_len=prompt_len + start,
            n_accepted=n,
            next_token=answer[start + n],
            committed_len=prompt_len + start + n + 1,
            draft_tokens=hosted,
            **fields,  # type: ignore[arg-type]
        )

    cloud = m.Policy(mode=m.Mode.CLOUD, draft_model="hybrid", k=4)
    assert drafter.apply_verdict(cloud_verdict(0, 0, 4, policy=cloud, continues=True)) == list(
        answer[:5]
    )
    # The stream goes on: round 1 is in flight without the agent sending anything.
    assert drafter.in_flight is not None and drafter.in_flight.cloud_k == 4
    assert drafter.in_flight.round == 1 and drafter.in_flight.base_len == prompt_len + 5
    back = m.Policy(mode=m.Mode.DISTRIBUTED, draft_model="hybrid", k=3)
    assert drafter.apply_verdict(cloud_verdict(1, 5, 2, policy=back)) == list(answer[5:8])
    assert drafter.in_flight is None
    assert drafter.generated == list(answer[:8])
    again = drafter.draft()  # distributed again: the device drafts
    assert again.cloud_k is None and len(again.tokens) <= 3
    assert [r.drafted for r in drafter.records] == [4, 4]


def test_a_cloud_verdict_without_its_draft_is_out_of_sync(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog
) -> None:
    _, tokenizer = target
    base = make_drafter(tokenizer, catalog, "code-01", draft="hybrid", k=4)
    drafter = SessionDrafter(
        spec=replace(base.spec, mode=m.Mode.CLOUD), proposer=base.proposer, eos_id=2
    )
    window = drafter.draft()
    verdict = m.Verdict(
        session_id=drafter.spec.session_id,
        round=0,
        base_len=window.base_len,
        n_accepted=0,
        next_token=5,
        committed_len=window.base_len + 1,
    )
    with pytest.raises(OutOfSync, match="lacks its draft"):
        drafter.apply_verdict(verdict)


@pytest.mark.parametrize("draft", ["draft-l1"])
def test_the_policys_min_confidence_cuts_neural_windows_short(
    target: tuple[OnnxRuntime, ChatTokenizer], catalog: DrafterCatalog, draft: str
) -> None:
    if not catalog.has(draft):
        pytest.skip(f"{draft} is not built in {catalog.models_dir}")
    runtime, tokenizer = target
    sure = m.Policy(draft_model=draft, k=6, min_confidence=0.0)
    unsure = m.Policy(draft_model=draft, k=6, min_confidence=0.999)
    lengths: dict[float, list[int]] = {}
    for policy in (sure, unsure):
        drafter = make_drafter(tokenizer, catalog, "summarize-01", draft=draft, k=6, max_tokens=24)
        judge = TargetJudge(runtime, tokenizer.eos_id, lambda _, policy=policy: policy)
        sent = run_rounds(drafter, judge)
        assert drafter.generated == reference("summarize-01", target, 24)
        assert policy.min_confidence is not None
        lengths[policy.min_confidence] = [len(d.tokens) for d in sent[1:]]
    # A draft this unsure of itself stops after its first token (min_tokens = 1).
    assert max(lengths[0.999]) <= 1
    assert max(lengths[0.0]) > 1
