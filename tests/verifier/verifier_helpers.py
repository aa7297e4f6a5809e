"""Prompts, greedy references and requests shared by the verifier tests."""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from broker.client import BusClient
from broker.messages import (
    Message,
    SamplingSpec,
    VerifierStatus,
    VerifyRequest,
    VerifyResult,
    VerifyResults,
    decode,
)
from core.aio import timeout
from inference.onnx_runtime import OnnxRuntime
from inference.sampling import SamplingParams
from inference.speculative import decode_target
from inference.tokenizer import ChatTokenizer
from modelbuild.target_build import load_target

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_PROMPTS = REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl"
GREEDY = SamplingParams(temperature=0.0)


@functools.cache
def target_pair() -> tuple[OnnxRuntime, ChatTokenizer]:
    """The real target of the default models directory, loaded once per test process."""
    return load_target()


@functools.cache
def shared_prompt(index: int) -> str:
    lines = [line for line in SHARED_PROMPTS.read_text().splitlines() if line.strip()]
    prompt: str = json.loads(lines[index])["prompt"]
    return prompt


@functools.cache
def prompt_ids(index: int) -> tuple[int, ...]:
    _, tokenizer = target_pair()
    return tuple(tokenizer.apply_chat_template(shared_prompt(index)))


@functools.cache
def greedy_reference(index: int, max_new_tokens: int) -> tuple[int, ...]:
    """The target's own greedy continuation of a shared prompt, one pass per token."""
    runtime, tokenizer = target_pair()
    result = decode_target(runtime, prompt_ids(index), max_new_tokens, GREEDY, eos=tokenizer.eos_id)
    return tuple(result.tokens)


def draft_from(reference: Sequence[int], start: int, k: int, wrong_at: int | None) -> list[int]:
    """k tokens of the reference from `start`, with the one at `wrong_at` replaced by another."""
    tokens = list(reference[start : start + k])
    if wrong_at is not None and wrong_at < len(tokens):
        tokens[wrong_at] = (tokens[wrong_at] + 1) % 49152
    return tokens


def make_request(
    session_id: str,
    round_index: int,
    context: Sequence[int],
    tokens: Sequence[int],
    sampling: SamplingSpec | None = None,
    q_ids: Sequence[Sequence[int]] | None = None,
    q_probs: Sequence[Sequence[float]] | None = None,
) -> VerifyRequest:
    return VerifyRequest(
        request_id=uuid.uuid4().hex,
        session_id=session_id,
        round=round_index,
        context_ids=tuple(context),
        tokens=tuple(tokens),
        sampling=sampling or SamplingSpec(),
        q_ids=None if q_ids is None else tuple(tuple(r) for r in q_ids),
        q_probs=None if q_probs is None else tuple(tuple(r) for r in q_probs),
    )


def cloud_request(
    session: str,
    round_index: int,
    context: Sequence[int],
    draft: str,
    k: int,
    sampling: SamplingSpec | None = None,
) -> VerifyRequest:
    """A cloud round: the verifier host drafts up to `k` tokens with `draft` after `context`."""
    return VerifyRequest(
        request_id=f"{session}-{round_index}",
        session_id=session,
        round=round_index,
        context_ids=tuple(context),
        tokens=(),
        sampling=sampling or SamplingSpec(),
        cloud_draft=draft,
        cloud_k=k,
    )


def _results(message: Message) -> tuple[VerifyResult, ...]:
    """The results a message carries: itself, a pass's batched results, or none."""
    if isinstance(message, VerifyResult):
        return (message,)
    return message.results if isinstance(message, VerifyResults) else ()


class BusListener:
    """The coordinator's side of a test: collects results and statuses of one verifier."""

    def __init__(self, client: BusClient) -> None:
        self.client = client
        self.results: dict[str, VerifyResult] = {}
        self.streamed: dict[str, list[VerifyResult]] = {}  # a host stream's rounds, by request id
        self.others: list[tuple[str, Message]] = []  # any other message, with its topic
        self.deliveries: Counter[str] = Counter()  # results received, by request id
        self.statuses: list[tuple[VerifierStatus, bool]] = []  # with the retain flag
        self.envelopes: list[int] = []  # the results of each VerifyResults received
        self._changed = asyncio.Condition()

    async def listen(self) -> None:
        async for incoming in self.client.messages():
            message = decode(incoming.payload)
            async with self._changed:
                results = _results(message)
                if isinstance(message, VerifyResults):
                    self.envelopes.append(len(results))
                for result in results:
                    self.results[result.request_id] = result
                    self.streamed.setdefault(result.request_id, []).append(result)
                    self.deliveries[result.request_id] += 1
                if isinstance(message, VerifierStatus):
                    self.statuses.append((message, incoming.retain))
                elif not results:
                    self.others.append((incoming.topic, message))
                self._changed.notify_all()

    async def result(self, request_id: str, timeout_s: float = 60.0) -> VerifyResult:
        async with timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: request_id in self.results)
        return self.results[request_id]

    async def other(
        self, predicate: Callable[[str, Message], bool], timeout_s: float = 60.0
    ) -> Message:
        """The first other message (with its topic) that satisfies `predicate`."""

        def found() -> bool:
            return any(predicate(topic, message) for topic, message in self.others)

        async with timeout(timeout_s), self._changed:
            await self._changed.wait_for(found)
        return next(message for topic, message in self.others if predicate(topic, message))

    async def stream_end(self, request_id: str, timeout_s: float = 90.0) -> list[VerifyResult]:
        """Every round of a host stream, once one says the stream ends."""

        def ended() -> bool:
            return any(r.stream_ends for r in self.streamed.get(request_id, []))

        async with timeout(timeout_s), self._changed:
            await self._changed.wait_for(ended)
        return self.streamed[request_id]

    async def status(
        self, predicate: Callable[[VerifierStatus], bool], timeout_s: float = 90.0
    ) -> VerifierStatus:
        async with timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: any(predicate(s) for s, _ in self.statuses))
        return next(s for s, _ in self.statuses if predicate(s))
