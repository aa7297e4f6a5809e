"""Rounds the coordinator answers: a device's draft verified, a host stream's rounds, each
through the stop rules, persisted, then published (persist before publish)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import sqlalchemy as sa

from broker import messages as m
from coordinator.db.models import Round, SessionStatus
from coordinator.runtime.direct_rounds import DirectRounds
from coordinator.runtime.round_model import CLOUD_STREAM_ROUNDS
from coordinator.runtime.session_state import LiveSession
from coordinator.runtime.verifiers import NoVerifierError, StreamLost, VerificationFailed
from inference.speculative import apply_stop_rules

log = logging.getLogger(__name__)

# Host streams of a session that may break off in a row (a verifier dies, the bus drops) before
# its device is told to ask again.
STREAM_ATTEMPTS = 4


class RoundPipeline(DirectRounds):
    """Drafts in, verdicts out: the rounds this coordinator verifies and commits."""

    async def on_draft(self, device_id: str, draft: m.Draft) -> None:
        received_at = time.time()
        live = await self.get(draft.session_id)
        if live is None or live.device_id != device_id:
            await self._error(
                device_id, m.Refused.DRAFT, draft.session_id, draft.round, "unknown session"
            )
            return
        live.last_heard = time.monotonic()
        if not draft.cloud and self._holder(live) is not None:
            return  # a direct round: the verifier holding the lease answers it
        async with live.lock:
            if draft.cloud:
                await self._unlease(live)  # the coordinator runs a host stream itself
            elif self._holder(live) is not None:
                return
            if draft.round < live.next_round:
                await self._resend_verdict(live, draft)
                return
            if live.status is not SessionStatus.ACTIVE:
                await self._error(
                    device_id,
                    m.Refused.DRAFT,
                    live.id,
                    draft.round,
                    f"session is {live.status.value}",
                )
                await self._send_state(live)
                return
            misfit = draft.misfit(
                live.next_round,
                live.committed_len,
                live.sampling.greedy,
                self.pool.vocab_size() or self.vocab_size,
            )
            if misfit is not None:
                await self._error(device_id, m.Refused.DRAFT, live.id, draft.round, misfit)
                if draft.round != live.next_round or draft.base_len != live.committed_len:
                    await self._send_state(live)  # out of step: the state resynchronises it
                return
            if draft.cloud and live.streaming:
                # Re-sent while its stream runs (the agent timed out): the state catches it up,
                # and says the stream runs, so that the agent waits rather than sends again.
                await self._send_state(live, streaming=True)
                return
            plain = live.policy.mode is m.Mode.PLAIN
            if draft.cloud and not plain and not self.can_draft(draft.draft_model):
                await self._error(
                    device_id,
                    m.Refused.DRAFT,
                    live.id,
                    draft.round,
                    f"no live verifier drafts cloud rounds with {draft.draft_model!r}",
                )
                return
            live.in_flight_round = draft.round
            try:
                if draft.cloud:
                    # A cloud request: the verifier host runs the rounds from this one on.
                    if live.policy.mode not in m.HOST_MODES:
                        live.policy = live.policy.model_copy(
                            update={
                                "mode": m.Mode.CLOUD,
                                "draft_model": draft.draft_model,
                                "k": draft.cloud_k or live.policy.k,
                            }
                        )
                    goes_on = True
                else:
                    goes_on = await self._verify_and_commit(live, draft, received_at)
            finally:
                live.in_flight_round = None
        if goes_on:
            await self._run_stream(live)

    async def _run_stream(self, live: LiveSession) -> None:
        """The session's host stream, unless one runs already."""
        if live.streaming:
            return
        live.streaming = True
        try:
            await self._host_stream(live)
        finally:
            live.streaming = False

    async def _verify_and_commit(
        self, live: LiveSession, draft: m.Draft, received_at: float
    ) -> bool:
        """One device-drafted round: verified, timed, then committed (stop rules, policy,
        persisted, published); True when the session goes on as a host stream."""
        verified = await self._verify_draft(live, draft)
        if verified is None:
            return False
        result, round_trip_ms = verified
        self._time_turn(live, draft, received_at, result)
        row = self._draft_row(live, draft, result, received_at, round_trip_ms)
        return await self._commit(
            live, row, result, draft.tokens, draft.timings.downlink_ms, draft.provisional
        )

    async def _verify_draft(
        self, live: LiveSession, draft: m.Draft
    ) -> tuple[m.VerifyResult, float] | None:
        """The verifier pool's verdict on the draft, and the round trip to it in ms; None (the
        device told why) when no verifier answered."""
        request = m.VerifyRequest(
            request_id="pending",
            session_id=live.id,
            round=draft.round,
            context_ids=tuple(live.prompt_ids + live.generated),
            tokens=draft.tokens,
            q_ids=draft.q_ids,
            q_probs=draft.q_probs,
            sampling=live.sampling,
            want_features=draft.want_features,
        )
        queued_at = time.perf_counter()
        try:
            result = await self.pool.verify(request)
        except (NoVerifierError, VerificationFailed) as exc:
            # Nothing was committed; the agent re-sends this round when it hears the state.
            log.error("round %d of %s not verified: %s", draft.round, live.id, exc)
            await self._error(
                live.device_id, m.Refused.DRAFT, live.id, draft.round, f"not verified: {exc}"
            )
            return None
        return result, (time.perf_counter() - queued_at) * 1000.0

    def _time_turn(
        self, live: LiveSession, draft: m.Draft, received_at: float, result: m.VerifyResult
    ) -> None:
        """The device's turn beyond compute since its previous round (for the policy), and this
        round's timing for the next one's."""
        live.turn_overhead_ms = None
        if live.last_draft is not None and live.last_draft[1] == draft.round - 1:
            at, _, verify_ms = live.last_draft
            turn_ms = (received_at - at) * 1000.0
            live.turn_overhead_ms = max(0.0, turn_ms - verify_ms - draft.timings.draft_ms)
        live.last_draft = (received_at, draft.round, result.verify_ms)

    def _draft_row(
        self,
        live: LiveSession,
        draft: m.Draft,
        result: m.VerifyResult,
        received_at: float,
        round_trip_ms: float,
    ) -> Round:
        """The round's row as the device drafted it, before the stop rules."""
        uplink_ms = max(0.0, (received_at - draft.timings.sent_at) * 1000.0)
        row = self._round_row(live, draft.round, draft.base_len, result)
        row.draft_tokens = list(draft.tokens)
        row.draft_model = draft.draft_model
        row.provisional = draft.provisional
        row.q_ids = [list(r) for r in draft.q_ids] if draft.q_ids else None
        row.q_probs = [list(r) for r in draft.q_probs] if draft.q_probs else None
        row.k = len(draft.tokens)
        row.mode = m.Mode.DISTRIBUTED
        row.t_draft_ms = draft.timings.draft_ms
        row.t_uplink_ms = uplink_ms if draft.timings.sent_at else None
        if draft.drafter_note:  # why the device drafted with another drafter (memory, a fetch)
            row.policy = {"device": {"note": draft.drafter_note}}
        # Everything between handing the draft to the pool and the verifier's compute:
        # transport both ways and the verifier's own queue.
        row.t_queue_ms = max(0.0, round_trip_ms - result.verify_ms)
        return row

    async def _host_stream(self, live: LiveSession) -> None:
        """Run the session on the verifier host while its policy says cloud or plain: each
        stream's rounds are persisted and published one by one as they come, while the verifier
        already runs the next. A stream that breaks off opens again from the last persisted
        round (a result never persisted is computed again, identically)."""
        failures = 0
        while self._hosted(live) and failures < STREAM_ATTEMPTS:
            request = self._stream_request(live)
            stream = self.pool.stream(request)
            draft, redrafted = request.cloud_draft, False
            try:
                async for result in stream:
                    async with live.lock:
                        if live.next_round != result.round or not self._hosted(live):
                            return  # closed, moved back to distributed, or taken over
                        live.in_flight_round = result.round
                        try:
                            ran = result.stream_draft if redrafted else request.cloud_draft
                            goes_on = await self._commit_streamed(live, request, result, ran)
                        finally:
                            live.in_flight_round = None
                    failures = 0
                    if not goes_on:
                        return
                    if self._stream_draft(live) != draft:
                        # The policy chose another host drafter (or none): the verifier drafts
                        # the stream's next pass with it (its rounds name the drafter they ran
                        # with). One that cannot has the stream end here (what it ran ahead is
                        # computed again: a pass more for the session) and the next open with
                        # the choice. Kept to the stream's end, a choice made within it waited
                        # up to 64 rounds: a whole answer.
                        draft, cloud_k, alpha = self._stream_window(live)
                        if not await self.pool.redraft(live.id, draft, cloud_k or None, alpha):
                            break
                        redrafted = True
            except StreamLost as exc:
                failures += 1
                log.warning("stream of %s broke off at round %d: %s", live.id, live.next_round, exc)
            except NoVerifierError as exc:
                log.error("no verifier for the stream of %s: %s", live.id, exc)
                failures = STREAM_ATTEMPTS
            finally:
                await stream.aclose()
        if self._hosted(live):
            # The agent re-sends its cloud request when it hears the state.
            await self._error(
                live.device_id,
                m.Refused.DRAFT,
                live.id,
                live.next_round,
                "the host stream broke off",
            )
            await self._send_state(live)

    @staticmethod
    def _stream_draft(live: LiveSession) -> str | None:
        """The host drafter a stream of the session opens with now (None: plain rounds)."""
        policy = live.policy
        cloud = policy.mode is m.Mode.CLOUD and min(policy.k, m.MAX_CLOUD_K) > 0
        return policy.draft_model if cloud else None

    def _stream_window(self, live: LiveSession) -> tuple[str | None, int, float | None]:
        """A stream's drafter (None: plain rounds), its cap (0 with none) and the coordinator's
        acceptance estimate for it, from the session's policy now."""
        policy = live.policy
        draft = self._stream_draft(live)
        cloud_k = min(policy.k, m.MAX_CLOUD_K) if draft is not None else 0
        if live.policy_task is not None and cloud_k:
            # The verifier chooses each pass's window for its whole batch, with what it sees
            # of the batch and of the drafter: the policy's k is a per-session guess, and a cap
            # at it kept a lone session's windows at 1-3 where 8 paid.
            cloud_k = max(cloud_k, self.policy.k_max)
        alpha = None
        if live.policy_task is not None and cloud_k:
            alpha = self.policy.alpha(live.device_id, policy.draft_model, live.policy_task)
        return draft, cloud_k, alpha

    def _stream_request(self, live: LiveSession) -> m.VerifyRequest:
        draft, cloud_k, alpha = self._stream_window(live)
        return m.VerifyRequest(
            request_id="pending",
            session_id=live.id,
            round=live.next_round,
            context_ids=tuple(live.prompt_ids + live.generated),
            tokens=(),
            sampling=live.sampling,
            cloud_draft=draft,
            cloud_k=cloud_k or None,
            stream=m.StreamSpec(
                rounds=CLOUD_STREAM_ROUNDS,
                max_new=max(1, live.max_tokens - len(live.generated)),
                eos_id=self.eos_id,
                task_type=live.policy_task or live.task_type or "chat",
                alpha=alpha,
                adaptive=live.policy_task is not None,
                batched=True,  # a pass's rounds in one VerifyResults (VerifierPool.on_results)
            ),
        )

    async def _commit_streamed(
        self,
        live: LiveSession,
        request: m.VerifyRequest,
        result: m.VerifyResult,
        stream_draft: str | None,
    ) -> bool:
        """A streamed round committed; `stream_draft`: the stream's drafter for it."""
        drafted = result.draft_tokens or ()
        row = self._round_row(live, result.round, result.base_len, result)
        row.draft_tokens = list(drafted)
        row.draft_model = stream_draft if drafted else None
        row.q_ids = [list(r) for r in result.q_ids] if result.q_ids else None
        row.q_probs = [list(r) for r in result.q_probs] if result.q_probs else None
        window = result.pass_choice.k if result.pass_choice is not None else len(drafted)
        adaptive = request.stream is None or request.stream.adaptive
        row.k = len(drafted)
        # Plain: no drafter was asked for, or the pass chose none (a fixed window cut to 0 at
        # the end of the output is still the session's cloud mode).
        plain = stream_draft is None or (adaptive and window == 0)
        row.mode = m.Mode.PLAIN if plain else m.Mode.CLOUD
        row.t_draft_ms = result.draft_ms
        row.t_queue_ms = result.queue_ms
        if result.pass_choice is not None:
            row.policy = {"pass": result.pass_choice.model_dump(mode="json")}
        return await self._commit(live, row, result, drafted, None, False)

    def _round_row(
        self, live: LiveSession, round_index: int, base_len: int, result: m.VerifyResult
    ) -> Round:
        return Round(
            session_id=uuid.UUID(live.id),
            round_index=round_index,
            base_len=base_len,
            verifier_id=result.verifier_id,
            t_verify_ms=result.verify_ms,
            t_downlink_ms=None,
            n_accepted=result.n_accepted,
            next_token=result.next_token if result.next_token is not None else 0,
            committed_len=base_len,
        )

    async def _commit(
        self,
        live: LiveSession,
        row: Round,
        result: m.VerifyResult,
        drafted: tuple[int, ...],
        downlink_ms: float | None,
        provisional: bool,
    ) -> bool:
        """A verified round through its steps: the stop rules, the policy's next choice, the
        row persisted, the session advanced, then its verdict published and the round observed.
        True when the session goes on as a host stream."""
        kept, finished = self._stop(live, row, result, drafted)
        self._choose_next(live, row, result, provisional)
        generated = live.generated + kept
        status = SessionStatus.FINISHED if finished else SessionStatus.ACTIVE
        if not self.acts_for(live.device_id):
            # Fenced: the shard's lock may be another coordinator's now; its new owner answers
            # the re-sent draft (nothing was stored or published here).
            log.warning("round %d of %s dropped: shard lock lost", row.round_index, live.id)
            return False
        gather = result.batch_size > 1  # its pass's other rows may be on their way to the writer
        if not await self._persist(live, row, generated, status, downlink_ms, gather):
            return False
        live.generated = generated
        live.next_round = row.round_index + 1
        live.status = status
        live.last_heard = time.monotonic()
        continues = self._hosted(live)
        verdict = self._verdict(live, row, result, drafted, finished, continues)
        live.last_verdict = verdict
        await self._send_verdict(live, verdict)
        await self._observe(live, row, drafted, provisional, finished)
        return continues

    def _stop(
        self, live: LiveSession, row: Round, result: m.VerifyResult, drafted: tuple[int, ...]
    ) -> tuple[list[int], bool]:
        """The stop rules (EOS, max_tokens) on the accepted tokens and the next one: what the
        round commits, on its row, and whether the session finishes."""
        accepted = list(drafted[: result.n_accepted])
        next_token = result.next_token if result.next_token is not None else accepted.pop()
        kept, finished = apply_stop_rules(
            len(live.generated), accepted, next_token, live.max_tokens, self.eos_id
        )
        row.n_accepted = len(kept) - 1
        row.next_token = kept[-1]
        row.committed_len = row.base_len + len(kept)
        return kept, finished

    def _choose_next(
        self, live: LiveSession, row: Round, result: m.VerifyResult, provisional: bool
    ) -> None:
        """The policy learns from the round and chooses the next one's mode, drafter and window;
        the decision goes on the row, with the pass's own choice and the device's note."""
        pass_choice = (row.policy or {}).get("pass")
        device_note = (row.policy or {}).get("device")
        # A provisional tail is no window the policy chose: it teaches the policy nothing.
        if live.policy_task is not None and not provisional:
            live.policy, row.policy = self._adapt(live, row, result.batch_prefilled > 0)
        else:
            row.policy = live.policy.model_dump(mode="json")
        if pass_choice is not None:
            row.policy = {**row.policy, "pass": pass_choice}
        if device_note is not None:
            row.policy = {**row.policy, "device": device_note}

    async def _persist(
        self,
        live: LiveSession,
        row: Round,
        generated: list[int],
        status: SessionStatus,
        downlink_ms: float | None,
        gather: bool = False,
    ) -> bool:
        """The round and the session's committed tokens in one transaction (before anything is
        published); False when the round was stored already, the device then told the state."""
        try:
            await self._writer.write(
                row,
                generated,
                status,
                device_id=live.device_id,
                downlink_ms=downlink_ms,
                gather=gather,
            )
        except sa.exc.IntegrityError:
            # Someone else answered this round (a verifier holding a lease this coordinator
            # had not heard of yet): the stored round is the answer.
            log.warning("round %d of %s was already stored; resending it", row.round_index, live.id)
            await self._reload(live)
            await self._send_state(live)
            return False
        return True

    def _verdict(
        self,
        live: LiveSession,
        row: Round,
        result: m.VerifyResult,
        drafted: tuple[int, ...],
        finished: bool,
        continues: bool,
    ) -> m.Verdict:
        """The verdict of a committed round, as the device reads it."""
        hosted_round = row.mode in (m.Mode.CLOUD, m.Mode.PLAIN)
        return m.Verdict(
            session_id=live.id,
            round=row.round_index,
            base_len=row.base_len,
            n_accepted=row.n_accepted,
            next_token=row.next_token,
            committed_len=live.committed_len,
            finished=finished,
            policy=self._agent_policy(live),
            verifier_id=result.verifier_id,
            draft_tokens=tuple(drafted) if hosted_round else None,
            continues=continues,
            # The features belong to next_token's position: only when the stop rules kept it.
            features=None if finished or hosted_round else result.features,
        )

    async def _observe(
        self,
        live: LiveSession,
        row: Round,
        drafted: tuple[int, ...],
        provisional: bool,
        finished: bool,
    ) -> None:
        """After the verdict left: the round's observers (metrics, the API's live views), what
        the target kept of a provisional tail, and a finished session let go."""
        for observe in self.round_observers:
            observe(live, row)
        if provisional:
            await self._reconciled(live, row.round_index, drafted, row.n_accepted, row.next_token)
        if finished:
            self._let_go(live)
            log.info(
                "session %s finished: %d tokens in %d rounds",
                live.id,
                len(live.generated),
                live.next_round,
            )

    async def _resend_verdict(self, live: LiveSession, draft: m.Draft) -> None:
        """A draft for a round already verified: the stored verdict, never a second commit."""
        if draft.cloud:
            # A cloud request re-sent: its stream may have run on, and the state has it all.
            await self._send_state(live)
            return
        verdict = live.last_verdict
        if verdict is None or verdict.round != draft.round:
            verdict = await asyncio.to_thread(self.store.stored_verdict, live, draft.round)
        if verdict is None:
            await self._error(
                live.device_id, m.Refused.DRAFT, live.id, draft.round, "unknown round"
            )
            return
        log.info("re-sent the verdict of round %d of %s", draft.round, live.id)
        await self._send_verdict(live, verdict)
