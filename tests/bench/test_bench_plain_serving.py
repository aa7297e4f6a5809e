"""The plain-serving baseline of `bench e2e` answers as the real target alone, batched or not."""

from __future__ import annotations

import pytest

from bench.plain_serving import PlainServer, PlainServingError, serve_wave
from tests.inference.real_target import greedy_reference, prompt_ids, target_pair

# chat-01 runs past 24 tokens; the target ends translate-07 after 15 tokens and summarize-05
# after 12, eos included, so the wave's batch shrinks as they stop.
PROMPTS = ("chat-01", "translate-07", "summarize-05")


@pytest.mark.parametrize("max_tokens", [1, 12, 24])
def test_a_wave_answers_as_the_target_decoding_alone(max_tokens: int) -> None:
    target, tokenizer = target_pair()
    wave = serve_wave(target, [prompt_ids(p) for p in PROMPTS], max_tokens, tokenizer.eos_id)
    assert wave.token_ids == [list(greedy_reference(p, max_tokens)) for p in PROMPTS]
    assert wave.passes == [len(tokens) for tokens in wave.token_ids]
    assert wave.wall_s == max(wave.elapsed_s)
    # One prefill per session gives its first token; each decode pass, one token per session.
    assert sum(wave.batch_sizes) == sum(wave.passes) - len(PROMPTS)
    assert wave.batch_sizes == sorted(wave.batch_sizes, reverse=True)
    # Every decode pass and every prompt's prefill is timed (what `sim calibrate` prices).
    assert len(wave.pass_ms) == len(wave.batch_sizes)
    assert len(wave.prefill_ms) == len(PROMPTS)
    assert all(ms > 0 for ms in [*wave.pass_ms, *wave.prefill_ms])


def test_sessions_stop_at_the_first_eos_which_is_kept() -> None:
    target, tokenizer = target_pair()
    wave = serve_wave(target, [prompt_ids(p) for p in PROMPTS], 24, tokenizer.eos_id)
    lengths = [len(tokens) for tokens in wave.token_ids]
    assert lengths == [24, 15, 12]
    for tokens in wave.token_ids[1:]:
        assert tokens[-1] == tokenizer.eos_id
        assert tokenizer.eos_id not in tokens[:-1]
    assert wave.batch_sizes == [3] * 11 + [2] * 3 + [1] * 9


def test_with_a_concurrency_the_next_session_starts_as_one_ends() -> None:
    """Two open at a time: summarize-05 (12 tokens) starts when translate-07 (15) ends, so the
    batch holds two until chat-01 (24) ends and summarize-05 finishes alone; the answers are the
    target's own, each session's time runs from its own start, and a concurrency of less than
    one is refused."""
    target, tokenizer = target_pair()
    ids = [prompt_ids(p) for p in PROMPTS]
    wave = serve_wave(target, ids, 24, tokenizer.eos_id, concurrency=2)
    assert wave.token_ids == [list(greedy_reference(p, 24)) for p in PROMPTS]
    assert max(wave.batch_sizes) == 2
    assert sum(wave.batch_sizes) == sum(wave.passes) - len(PROMPTS)
    # translate-07 ends after pass 14, chat-01 after pass 23, summarize-05 (from its prefill
    # before pass 15) after pass 25.
    assert wave.batch_sizes == [2] * 23 + [1] * 2
    assert wave.elapsed_s[2] < wave.wall_s and wave.wall_s >= max(wave.elapsed_s)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        serve_wave(target, ids, 4, tokenizer.eos_id, concurrency=0)
    with PlainServer() as server:
        served = server.serve(ids, 8, tokenizer.eos_id, concurrency=1)
    assert served.token_ids == [list(greedy_reference(p, 8)) for p in PROMPTS]
    assert set(served.batch_sizes) == {1}


def test_the_process_serves_one_wave_after_another_and_refuses_a_bad_one() -> None:
    _, tokenizer = target_pair()
    with PlainServer() as server:
        assert server.load_s is not None and server.load_s > 0
        first = server.serve([prompt_ids(p) for p in PROMPTS], 16, tokenizer.eos_id)
        with pytest.raises(PlainServingError, match="at least one token"):
            server.serve([[]], 16, tokenizer.eos_id)
        alone = server.serve([prompt_ids(PROMPTS[0])], 16, tokenizer.eos_id)
    assert first.token_ids == [list(greedy_reference(p, 16)) for p in PROMPTS]
    assert alone.token_ids == [list(greedy_reference(PROMPTS[0], 16))]
    assert alone.batch_sizes == [1] * 15


def test_a_stopped_server_refuses_waves() -> None:
    server = PlainServer()
    with pytest.raises(PlainServingError, match="not running"):
        server.serve([[1, 2]], 4, 2)
