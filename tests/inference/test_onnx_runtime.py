"""The real target through OnnxRuntime: greedy answer, verification windows, rollback, batching."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest

from inference.onnx_runtime import DEAD_SLOTS_MIN, OnnxKVCache, OnnxRuntime
from inference.tokenizer import ChatTokenizer

Target = tuple[OnnxRuntime, ChatTokenizer]
FRANCE = "What is the capital of France?"
# Where two computations run different kernel shapes (one row against many, a padded batch against
# a lone sequence), fp32 sums differ in their last bits: measured max |diff| 6e-5 (fp32) and
# 2e-4 (q4) on logits of magnitude ~20.
LOGIT_TOLERANCE = 1e-3


def greedy(runtime: OnnxRuntime, prompt: list[int], eos_id: int, limit: int) -> list[int]:
    cache = runtime.new_cache()
    logits = runtime.forward(prompt, cache)
    generated: list[int] = []
    while len(generated) < limit:
        token = int(logits[-1].argmax())
        if token == eos_id:
            break
        generated.append(token)
        logits = runtime.forward([token], cache)
    return generated


def prefix_and_continuation(target: Target) -> tuple[list[int], list[int]]:
    runtime, tokenizer = target
    prompt = tokenizer.apply_chat_template("Tell me about the city of Paris.")
    continuation = greedy(runtime, prompt, tokenizer.eos_id, 8)
    assert len(continuation) == 8
    return prompt, continuation


def test_greedy_chat_answer(any_target: Target) -> None:
    runtime, tokenizer = any_target
    prompt = tokenizer.apply_chat_template(FRANCE)
    answer = greedy(runtime, prompt, tokenizer.eos_id, 32)
    assert tokenizer.decode(answer) == "The capital of France is Paris."


def test_runtime_describes_its_model(target: Target) -> None:
    runtime, _ = target
    assert runtime.vocab_size == 49152
    assert runtime.config.n_layers == 30
    assert runtime.head_ids is None
    assert runtime.new_cache().length == 0
    assert runtime.has_hidden


def test_hidden_state_rides_with_logits(target: Target) -> None:
    runtime, tokenizer = target
    prompt = tokenizer.apply_chat_template(FRANCE)
    (step,) = runtime.run_batch([(prompt, runtime.new_cache())], with_hidden=True)
    assert step.hidden is not None
    assert step.hidden.shape == (len(prompt), runtime.hidden_size)
    assert np.isfinite(step.hidden).all()
    # Asking for the features leaves the logits bit for bit as they were, and a pass that does
    # not ask gets none.
    (plain,) = runtime.run_batch([(prompt, runtime.new_cache())])
    assert plain.hidden is None
    np.testing.assert_array_equal(plain.logits, step.logits)
    ((logits, hidden),) = runtime.forward_batch_hidden([(prompt, runtime.new_cache())])
    np.testing.assert_array_equal(logits, step.logits)
    np.testing.assert_array_equal(hidden, step.hidden)


def window_and_steps(
    runtime: OnnxRuntime, prompt: list[int], draft: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Logits of the last prompt token plus a draft, scored in one call and one token at a time."""
    stepped = runtime.new_cache()
    runtime.forward(prompt[:-1], stepped)
    step_logits = np.stack([runtime.forward([t], stepped)[0] for t in [prompt[-1], *draft]])

    verified = runtime.new_cache()
    runtime.forward(prompt[:-1], verified)
    window_logits = runtime.forward([prompt[-1], *draft], verified)
    assert verified.length == stepped.length == len(prompt) + len(draft)
    return window_logits, step_logits


@pytest.mark.parametrize("k", range(1, 9))
def test_verify_window_equals_step_by_step_exactly(any_target: Target, k: int) -> None:
    """Scoring a draft of k tokens in one call gives bit for bit the logits of decoding them."""
    runtime, _ = any_target
    assert runtime.consistent_decode
    prompt, continuation = prefix_and_continuation(any_target)
    window_logits, step_logits = window_and_steps(runtime, prompt, continuation[:k])
    assert window_logits.shape == (k + 1, runtime.vocab_size)
    np.testing.assert_array_equal(window_logits, step_logits)


@pytest.fixture(scope="module")
def fast_runtime(target_dir: Path) -> OnnxRuntime:
    return OnnxRuntime(target_dir / "model.onnx", consistent_decode=False)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_fast_decode_matches_verify_within_tolerance(
    target: Target, fast_runtime: OnnxRuntime, k: int
) -> None:
    """Without consistent decoding, one-row steps differ only in the last bits; argmax agrees."""
    fast = fast_runtime
    prompt, continuation = prefix_and_continuation(target)
    window_logits, step_logits = window_and_steps(fast, prompt, continuation[:k])
    np.testing.assert_allclose(window_logits, step_logits, rtol=0, atol=LOGIT_TOLERANCE)
    assert (window_logits.argmax(-1) == step_logits.argmax(-1)).all()


def test_trim_then_forward_repeats_exactly(target: Target) -> None:
    runtime, tokenizer = target
    prompt = tokenizer.apply_chat_template(FRANCE)
    cache = runtime.new_cache()
    runtime.forward(prompt, cache)
    committed = cache.length
    first = runtime.forward([578, 6303, 314], cache)
    rejected = runtime.forward([42, 43], cache)
    assert cache.length == committed + 5
    cache.trim(committed)
    assert cache.length == committed
    again = runtime.forward([578, 6303, 314], cache)
    np.testing.assert_array_equal(again, first)
    cache.trim(committed + 1)
    np.testing.assert_array_equal(runtime.forward([6303, 314], cache), first[1:])
    assert not np.array_equal(rejected[0], first[0])


def test_trim_refuses_growth(target: Target) -> None:
    runtime, _ = target
    cache = runtime.new_cache()
    runtime.forward([1, 2, 3], cache)
    with pytest.raises(ValueError, match="trim"):
        cache.trim(4)


def test_forward_batch_equals_single_forwards(any_target: Target) -> None:
    """Different past lengths and draft lengths share one padded pass; each row keeps its answer."""
    runtime, tokenizer = any_target
    prompts = [
        tokenizer.apply_chat_template(FRANCE),
        tokenizer.apply_chat_template("Name three colours."),
        tokenizer.encode("Once upon a time"),
        tokenizer.apply_chat_template("Write a haiku about the sea, please, in English."),
    ]
    drafts = [[578, 6303], [330], [28, 253, 1700, 314, 260], [504, 1230, 29]]

    singles: list[np.ndarray] = []
    single_caches: list[OnnxKVCache] = []
    for prompt, draft in zip(prompts, drafts, strict=True):
        cache = runtime.new_cache()
        runtime.forward(prompt, cache)
        singles.append(runtime.forward(draft, cache))
        single_caches.append(cache)

    batch_caches = []
    for prompt in prompts:
        cache = runtime.new_cache()
        runtime.forward(prompt, cache)
        batch_caches.append(cache)
    batched = runtime.forward_batch(list(zip(drafts, batch_caches, strict=True)))

    for single, joint, cache, expected_cache, prompt, draft in zip(
        singles, batched, batch_caches, single_caches, prompts, drafts, strict=True
    ):
        assert joint.shape == single.shape == (len(draft), runtime.vocab_size)
        np.testing.assert_allclose(joint, single, rtol=0, atol=LOGIT_TOLERANCE)
        assert (joint.argmax(-1) == single.argmax(-1)).all()
        assert cache.length == len(prompt) + len(draft)
        for got, want in zip(
            cache.keys + cache.values, expected_cache.keys + expected_cache.values, strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOLERANCE)

    # The caches a batch leaves behind go on decoding like the single ones.
    follow = runtime.forward_batch([([13], c) for c in batch_caches])
    for logits, cache in zip(follow, single_caches, strict=True):
        np.testing.assert_allclose(
            logits, runtime.forward([13], cache), rtol=0, atol=LOGIT_TOLERANCE
        )


def test_forward_batch_of_prefills_from_empty_caches(target: Target) -> None:
    runtime, tokenizer = target
    prompts = [tokenizer.encode("Hello there"), tokenizer.encode("A much longer opening line here")]
    batched = runtime.forward_batch([(p, runtime.new_cache()) for p in prompts])
    for prompt, joint in zip(prompts, batched, strict=True):
        single = runtime.forward(prompt, runtime.new_cache())
        np.testing.assert_allclose(joint, single, rtol=0, atol=LOGIT_TOLERANCE)


def test_forward_rejects_empty_input(target: Target) -> None:
    runtime, _ = target
    with pytest.raises(ValueError, match="at least one"):
        runtime.forward([], runtime.new_cache())


def _decode_rows(
    runtime: OnnxRuntime, prompts: list[list[int]], steps: int, stack_every_pass: bool
) -> tuple[list[np.ndarray], list[OnnxKVCache]]:
    """Prefill each prompt, then `steps` batched passes: one greedy token a row, except that
    the second row sends a window of three after the second pass, of which the third pass
    rejects all but one (as a verdict leaves it), and the third row a window of two in the
    fifth pass, kept whole. `stack_every_pass` takes every cache out of its pass first, so that
    each pass stacks the rows anew."""
    caches = []
    tokens: list[list[int]] = []
    for prompt in prompts:
        cache = runtime.new_cache()
        tokens.append([int(runtime.forward(prompt, cache)[-1].argmax())])
        caches.append(cache)
    logits_seen = []
    for step in range(steps):
        if stack_every_pass:
            for cache in caches:
                cache._detach()
        rows = runtime.forward_batch(list(zip(tokens, caches, strict=True)))
        logits_seen += rows
        tokens = [[int(row[-1].argmax())] for row in rows]
        if step == 1:
            tokens[1] = [tokens[1][0], 13, 28]
        if step == 2:
            caches[1].trim(caches[1].length - 2)
            tokens[1] = [int(rows[1][0].argmax())]
        if step == 3:
            tokens[2] = [tokens[2][0], 13]
    return logits_seen, caches


def _counting_stacks(runtime: OnnxRuntime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    stacks: list[int] = []
    stack = runtime._stack_pasts

    def counted(feeds, caches, lengths):  # type: ignore[no-untyped-def]
        stacks.append(len(caches))
        return stack(feeds, caches, lengths)

    monkeypatch.setattr(runtime, "_stack_pasts", counted)
    return stacks


def test_rows_of_one_pass_go_on_in_its_presents_with_dead_slots_masked(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batched decoding feeds a pass's presents to the next pass over the same rows, rejected
    positions and right padding left in place as dead slots, instead of stacking the rows'
    caches again. Logits and caches agree with stacking every pass, to the last bits of a
    different kernel shape, and so do the greedy tokens."""
    runtime, tokenizer = target
    prompts = [
        tokenizer.apply_chat_template(FRANCE),
        tokenizer.apply_chat_template("Name three colours."),
        tokenizer.encode("Once upon a time"),
    ]
    reference, reference_caches = _decode_rows(runtime, prompts, 6, stack_every_pass=True)
    stacks = _counting_stacks(runtime, monkeypatch)
    in_place, caches = _decode_rows(runtime, prompts, 6, stack_every_pass=False)
    # The three prefills (a row each) and the first batched pass stack; the other five passes,
    # the window, the rollback and the padding included, go on in the pass before.
    assert stacks == [1, 1, 1, 3]
    assert caches[1]._valid is not None and not caches[1]._valid[-8:].all()  # dead slots
    for got, want in zip(in_place, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOLERANCE)
        assert (got.argmax(-1) == want.argmax(-1)).all()
    for cache, expected in zip(caches, reference_caches, strict=True):
        assert cache.length == expected.length
        pairs = zip(cache.keys + cache.values, expected.keys + expected.values, strict=True)
        for got, want in pairs:
            np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOLERANCE)


def test_some_rows_of_a_pass_are_taken_from_it_and_the_rest_copied_out(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime, tokenizer = target
    prompts = [tokenizer.encode(text) for text in ("Hello there", "Once upon a time", "Paris is")]
    caches = [runtime.new_cache() for _ in prompts]
    runtime.forward_batch(list(zip(prompts, caches, strict=True)))
    left = caches[1]
    expected = left.copy()
    stacks = _counting_stacks(runtime, monkeypatch)
    two = runtime.forward_batch([([13], caches[2]), ([13], caches[0])])
    assert stacks == []  # taken from the pass before, in the new order
    assert left._pass is None  # the row left behind has its own arrays again
    for got, want in zip(left.keys + left.values, expected.keys + expected.values, strict=True):
        np.testing.assert_array_equal(got, want)
    for logits, prompt in zip(two, [prompts[2], prompts[0]], strict=True):
        alone = runtime.new_cache()
        runtime.forward(prompt, alone)
        np.testing.assert_allclose(
            logits, runtime.forward([13], alone), rtol=0, atol=LOGIT_TOLERANCE
        )


def test_too_many_dead_slots_stack_the_rows_anew(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows rejected pass after pass would grow every pass by their dead slots; past
    DEAD_SLOTS_MIN the rows are stacked again, with their positions only."""
    runtime, tokenizer = target
    prompts = [tokenizer.encode("Hello there"), tokenizer.encode("Once upon a time")]
    caches = [runtime.new_cache() for _ in prompts]
    runtime.forward_batch(list(zip(prompts, caches, strict=True)))
    stacks = _counting_stacks(runtime, monkeypatch)
    passes = 0
    while not stacks:
        lengths = [cache.length for cache in caches]
        runtime.forward_batch([([13, 28, 29, 30], cache) for cache in caches])
        for cache, length in zip(caches, lengths, strict=True):
            cache.trim(length + 1)
        passes += 1
        assert passes < 10
    # Each pass leaves 3 dead slots beyond the longest row: the seventh starts with 18, more
    # than DEAD_SLOTS_MIN, and stacks.
    assert DEAD_SLOTS_MIN == 16 and passes == 7 and stacks == [2]
    # The stacked pass held the longest row's positions only: its window's 3 rejected are all
    # that is dead of it now.
    assert caches[1]._valid is not None and len(caches[1]._valid) == caches[1].length + 3
    for cache, prompt in zip(caches, prompts, strict=True):
        alone = runtime.new_cache()
        runtime.forward(prompt + [13] * passes, alone)
        np.testing.assert_allclose(
            runtime.forward([13], cache.copy()),
            runtime.forward([13], alone),
            rtol=0,
            atol=LOGIT_TOLERANCE,
        )


def test_the_time_spent_stacking_rows_is_counted_apart(target: Target) -> None:
    """Goodput control times a pass's shape without it: stacking is paid when the rows change."""
    runtime, tokenizer = target
    caches = [runtime.new_cache() for _ in range(2)]
    for cache, text in zip(caches, ("Hello there", "Once upon a time"), strict=True):
        runtime.forward(tokenizer.encode(text), cache)
    before = runtime.stack_ms
    runtime.forward_batch([([13], cache) for cache in caches])
    stacked = runtime.stack_ms
    assert stacked > before
    runtime.forward_batch([([13], cache) for cache in caches])  # in place
    assert runtime.stack_ms == stacked


def test_taking_rows_out_of_a_pass_is_counted_with_stacking(target: Target) -> None:
    """A session that leaves the batch makes the next pass copy the rows kept out of the last
    one's presents: paid because the rows changed, whatever the window, so counted apart as
    stacking is; the pass after, on the same rows, runs in place again."""
    runtime, tokenizer = target
    caches = [runtime.new_cache() for _ in range(3)]
    for cache in caches:
        runtime.forward(tokenizer.encode("Once upon a time"), cache)
    runtime.forward_batch([([13], cache) for cache in caches])  # stacked: three rows of none
    stacked = runtime.stack_ms
    runtime.forward_batch([([13], cache) for cache in caches])  # in place, as they are
    assert runtime.stack_ms == stacked
    kept = [caches[0], caches[2]]  # the middle session ended
    source = kept[0]._pass
    runtime.forward_batch([([13], cache) for cache in kept])
    assert kept[0]._pass is not source  # ran on the rows taken out of the last pass
    taken = runtime.stack_ms
    assert taken > stacked
    runtime.forward_batch([([13], cache) for cache in kept])
    assert runtime.stack_ms == taken


def test_a_pass_does_not_keep_a_dropped_cache_alive(target: Target) -> None:
    """The verifier drops an evicted session's cache while its pass's other rows go on: the
    pass holds its rows weakly, so that the cache goes (and is not copied out for nobody)."""
    runtime, tokenizer = target
    caches = [runtime.new_cache() for _ in range(3)]
    runtime.forward_batch([(tokenizer.encode("Hello there"), cache) for cache in caches])
    dropped = weakref.ref(caches.pop())
    gc.collect()
    assert dropped() is None
    runtime.forward_batch([([13], cache) for cache in caches])
    assert all(cache.length == 3 for cache in caches)
