"""LLMEngine: the step loop gluing scheduler, runner, sampler, detokenizer and outputs.

Per step:

    plan = scheduler.schedule()            # who runs, which blocks, which rows are sampled
    runner.copy_blocks(plan.copy_pairs)    # copy-on-write before any write
    logits = runner.execute(plan)          # [sampling chunks, vocab]
    tokens = sampler(logits rows expanded to every sampled sequence)
    scheduler.update(plan, tokens)         # token stops, frees finished blocks
    detokenize, stop strings -> scheduler.finish_sequence, RequestOutput per touched request

The last stage runs request by request: one that raises there (a tokenizer that cannot decode
one of its ids, a bug confined to it) is aborted alone, its blocks freed, and its final output
carries a `RequestFailedError` (`RequestOutput.error`); the other requests of the step go on.

Not thread-safe: one thread drives it (the async engine serialises calls onto its worker).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.detokenizer import SequenceText
from kvmesh.engine.engine_setup import EngineParts, build_engine_parts
from kvmesh.engine.errors import InvalidParameterError, RequestFailedError
from kvmesh.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvmesh.engine.prompt_logprobs import PromptLogprobs, PromptRows, rows_of_step, score
from kvmesh.engine.sampler import SamplingBatch, SamplingRow, TokenLogprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import SchedulerOutput
from kvmesh.engine.sequence import Request, Sequence, SequenceStatus

PromptInput = str | Seq[int]
LOG = logging.getLogger("kvmesh.engine")


@dataclass
class _Tracked:
    """Engine-side state of one request: texts, per-sequence outputs, timings."""

    request: Request
    prompt: str | None
    prompt_logprobs: PromptLogprobs | None = None  # while asked for, until complete
    texts: dict[str, SequenceText] = field(default_factory=dict)
    outputs: dict[str, CompletionOutput] = field(default_factory=dict)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))


class LLMEngine:
    """Offline engine: `add_request`, then `step()` until `has_unfinished()` is False."""

    def __init__(self, config: EngineConfig | None = None, parts: EngineParts | None = None):
        self.config = config or EngineConfig()
        self.parts = parts or build_engine_parts(self.config)
        self.scheduler = self.parts.scheduler
        self.runner = self.parts.runner
        self.sampler = self.parts.sampler
        self.tokenizer = self.parts.loaded.tokenizer
        self._tracked: dict[str, _Tracked] = {}
        self._seq_request: dict[str, str] = {}
        self._step_logprobs: dict[str, TokenLogprobs] = {}
        self._owing: dict[str, PromptLogprobs] = {}  # prompt seq id -> logprobs still owed
        # Called with the tokens each non-empty step schedules (in the stepping thread).
        self.step_observers: list[Callable[[int], None]] = []
        self.last_step_empty = False  # the last step's plan held nothing (work waits for room)
        if self.config.show_progress:
            print(self.parts.capacity_line(), file=sys.stderr)

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Validate and queue a request (InvalidParameterError names the bad field)."""
        params = params or SamplingParams()
        prompt_ids, text = self.encode_prompt(prompt)
        params.validate_for_model(self.runner.vocab_size)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        request = Request.from_prompt(
            request_id, prompt_ids, params, arrival_time=arrival, prefill_only=prefill_only
        )
        self.scheduler.add_request(request)
        self._prefetch(request)
        tracked = _Tracked(request, text, metrics=RequestMetrics(arrival))
        self._tracked[request_id] = tracked
        self._owe_prompt_logprobs(tracked)
        self._seq_request[request_id] = request_id
        return request

    def _prefetch(self, request: Request) -> None:
        """Start reading the request's prefix blocks that lie on the disk tier now, before
        admission (a lookup then finds them on the host instead of reading in the step)."""
        tiers = self.parts.tiers
        if tiers is not None and tiers.disk is not None:
            head = request.seqs[0]
            tiers.prefetch(
                self.scheduler.block_manager.block_hashes(head.prompt_ids, head.extra_key)
            )

    def encode_prompt(self, prompt: PromptInput) -> tuple[list[int], str | None]:
        """Token ids of a text or token-id prompt, checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError("prompt", "text needs a tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt)), prompt
        ids = list(prompt)
        vocab = self.runner.vocab_size
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidParameterError("prompt_token_ids", f"{token_id!r} is not an int")
            if not 0 <= token_id < vocab:
                raise InvalidParameterError(
                    "prompt_token_ids", f"token id {token_id} is outside [0, {vocab})"
                )
        return ids, None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its final output, or None if unknown."""
        tracked = self._tracked.get(request_id)
        self.scheduler.abort_request(request_id)
        if tracked is None:
            return None
        try:
            return self._finish_output(tracked)
        except Exception as exc:  # its held-back text did not decode: it ends failed
            return self._fail(request_id, exc)

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def close(self) -> None:
        """Release what outlives a step: the KV tiers' reader (a persistent disk tier is
        written back). Idempotent."""
        tiers = self.parts.tiers
        if tiers is not None and not tiers.closed:
            if tiers.disk is not None and tiers.disk.persist:
                self.scheduler.block_manager.evict_all()  # device-cached blocks go down too
            tiers.close()

    def move_kv_cache(self, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Re-home the KV cache into `data` (and `scales`), contents kept (a decode worker's
        registered shared memory): the runner and the host/disk tiers' device side both move.
        Call on the engine thread, between steps."""
        self.runner.move_kv_cache(data, scales)
        if self.parts.tiers is not None:
            self.parts.tiers.device.rebind(self.runner.kv_cache)

    # -- built requests (the KV connector in kvmesh.engine.disagg adds and imports these) ---
    def add_built_request(self, request: Request) -> None:
        """Queue a Request built elsewhere (validated, carrying its prefix-cache salt); its disk
        blocks are prefetched as `add_request`'s are."""
        self.scheduler.add_request(request)
        self._prefetch(request)
        self._owe_prompt_logprobs(self._track(request))

    def _owe_prompt_logprobs(self, tracked: _Tracked) -> None:
        """A request that will compute its prompt here and asked for prompt logprobs owes
        them until its prompt is scored (imported requests computed theirs elsewhere)."""
        request = tracked.request
        top = request.params.prompt_logprobs
        if top is not None:
            tracked.prompt_logprobs = PromptLogprobs(top, list(request.seqs[0].prompt_ids))
            self._owing[request.seqs[0].seq_id] = tracked.prompt_logprobs

    def forget_request(self, request_id: str) -> None:
        """Stop tracking a request the scheduler no longer holds (its outputs end here)."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self._owing.pop(tracked.request.seqs[0].seq_id, None)
            for seq in tracked.request.seqs:
                self._seq_request.pop(seq.seq_id, None)

    def emit_imported(
        self, request: Request, first_logprobs: Seq[TokenLogprobs | None] = ()
    ) -> RequestOutput:
        """Track a request the scheduler just joined with tokens sampled elsewhere (its
        sequences' output ids) and return the output carrying them; `first_logprobs[i]` is
        completion i's first token's logprobs."""
        tracked = self._track(request)
        now = time.monotonic()
        for index, seq in enumerate(list(request.seqs)):
            logprobs = first_logprobs[index] if index < len(first_logprobs) else None
            if logprobs is not None:
                self._step_logprobs[seq.seq_id] = logprobs
            try:
                self._record_token(tracked, seq, now)
            finally:
                self._step_logprobs.pop(seq.seq_id, None)
        return self._emit(tracked)

    def _track(self, request: Request) -> _Tracked:
        tracked = _Tracked(request, None, metrics=RequestMetrics(request.arrival_time))
        self._tracked[request.request_id] = tracked
        for seq in request.seqs:
            self._seq_request[seq.seq_id] = request.request_id
        return tracked

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of every request that changed."""
        plan = self.scheduler.schedule()
        self.last_step_empty = plan.is_empty
        if plan.is_empty:
            return []
        if self.parts.tiers is not None:
            self.parts.tiers.prepare_step()  # reloads land before any write or read
        for observe in self.step_observers:
            observe(plan.num_batched_tokens)
        self.runner.copy_blocks(plan.copy_pairs)
        started = time.perf_counter()
        prompt_rows = rows_of_step(plan, self._owing)  # rows scoring prompt tokens, if any
        hidden = None
        if prompt_rows is None:
            logits = self.runner.execute(plan)  # [sampling chunks, vocab]
        else:
            logits, hidden = self.runner.execute_keeping(plan, prompt_rows.rows)
        tokens = len(plan.token_ids)
        if self.parts.tiers is not None and tokens > 2 * len(plan.seq_ids):  # mostly prompt
            self.parts.tiers.rates.observe_compute(tokens, time.perf_counter() - started)
        if prompt_rows is not None:
            assert hidden is not None  # [len(prompt_rows.rows), hidden]
            self._score_prompts(prompt_rows, hidden)
        sampled = self._sample(plan, logits)
        changed = self.scheduler.update(plan, sampled)
        now = time.monotonic()
        touched: dict[str, list[Sequence]] = {}
        for seq in changed:
            touched.setdefault(seq.request_id, []).append(seq)
        outputs: list[RequestOutput] = []
        try:
            for request_id, seqs in touched.items():
                output = self._post_process(request_id, seqs, now)
                if output is not None:
                    outputs.append(output)
        finally:
            self._step_logprobs.clear()
        return outputs

    def _post_process(
        self, request_id: str, seqs: list[Sequence], now: float
    ) -> RequestOutput | None:
        """The step's output of one request (its new tokens detokenized, stop strings looked
        for); a request that raises here fails alone (`_fail`)."""
        try:
            tracked = self._tracked[request_id]
            for seq in seqs:
                self._record_token(tracked, seq, now)
            return self._emit(tracked)
        except Exception as exc:
            return self._fail(request_id, exc)

    def _fail(self, request_id: str, error: Exception) -> RequestOutput | None:
        """Abort a request that raised in the step (its blocks freed, forgotten here); its
        final output, whose `error` names the request and the cause and whose unfinished
        completions end with finish_reason "error", or None when it was not tracked."""
        LOG.error("request %r failed in the engine step; aborted", request_id, exc_info=error)
        self.scheduler.abort_request(request_id)
        tracked = self._tracked.get(request_id)
        self.forget_request(request_id)
        if tracked is None:
            return None
        request = tracked.request
        for index, seq in enumerate(request.seqs):
            out = tracked.outputs.setdefault(
                seq.seq_id, CompletionOutput(index=index, text="", token_ids=[])
            )
            if out.finish_reason is None:
                out.finish_reason, out.stop_reason, out.new_finish = "error", None, True
        tracked.metrics.finished_time = time.monotonic()
        output = self._snapshot(tracked, finished=True)
        output.error = RequestFailedError(request_id, f"{type(error).__name__}: {error}")
        return output

    @torch.inference_mode()
    def _score_prompts(self, rows: PromptRows, hidden: torch.Tensor) -> None:
        """Score the step's prompt rows (hidden [rows, hidden]); forget completed prompts."""
        score(rows, hidden, self.runner.executor.compute_logits)
        for seq_id in [s for s, owed in self._owing.items() if owed.complete]:
            del self._owing[seq_id]

    def _sample(self, plan: SchedulerOutput, logits: torch.Tensor) -> dict[str, int]:
        """One token per sampled sequence; n > 1 children share their chunk's logits row."""
        row_of_chunk: list[int] = []
        rows: list[SamplingRow] = []
        seq_ids: list[str] = []
        chunk_row = 0
        for group in plan.sample_groups():  # the sequences sampling from each logits row
            request = self._tracked[self._seq_request[group[0]]].request
            for seq_id in group:
                self._seq_request.setdefault(seq_id, request.request_id)
                seq = _find_seq(request, seq_id)
                index = request.seqs.index(seq)
                rows.append(SamplingRow(seq.params, seq.prompt_ids, seq.output_ids, None, index))
                row_of_chunk.append(chunk_row)
                seq_ids.append(seq_id)
            chunk_row += 1
        if len(row_of_chunk) != chunk_row:
            logits = logits[torch.tensor(row_of_chunk)]  # [sampled sequences, vocab]
        batch = SamplingBatch.build(rows, self.parts.eos_token_ids)
        result = self.sampler(logits, batch)
        for seq_id, logprobs in zip(seq_ids, result.logprobs, strict=True):
            if logprobs is not None:
                self._step_logprobs[seq_id] = logprobs
        return dict(zip(seq_ids, result.token_ids.tolist(), strict=True))

    def _record_token(self, tracked: _Tracked, seq: Sequence, now: float) -> None:
        out = tracked.outputs.get(seq.seq_id)
        if out is None:
            out = self._new_completion(tracked, seq)
        new_ids = seq.output_ids[len(out.token_ids) :]
        out.token_ids.extend(new_ids)
        out.new_token_ids.extend(new_ids)
        out.token_times.extend([now] * len(new_ids))
        logprobs = self._step_logprobs.get(seq.seq_id)
        if logprobs is not None:
            out.logprobs = [*(out.logprobs or []), logprobs]
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + logprobs.sampled_logprob
        if tracked.metrics.first_token_time is None:
            tracked.metrics.first_token_time = now
        text = tracked.texts[seq.seq_id]
        out.new_text += text.append(_visible_ids(seq, new_ids))
        if seq.status.is_finished:
            out.new_text += text.flush()
        out.text = text.text
        if text.stopped_by is not None and not seq.status.is_finished:
            self.scheduler.finish_sequence(seq.seq_id, "stop", text.stopped_by)
        running = out.finish_reason is None
        out.finish_reason = seq.finish_reason
        out.stop_reason = seq.stop_reason
        if text.stopped_by is not None:
            out.finish_reason, out.stop_reason = "stop", text.stopped_by
        out.new_finish |= running and out.finish_reason is not None

    def _new_completion(self, tracked: _Tracked, seq: Sequence) -> CompletionOutput:
        params = seq.params
        stops = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop)
        tracked.texts[seq.seq_id] = SequenceText(
            self.tokenizer if params.detokenize else None,
            seq.prompt_ids,
            stops,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            params.min_tokens,
        )
        out = CompletionOutput(index=tracked.request.seqs.index(seq), text="", token_ids=[])
        tracked.outputs[seq.seq_id] = out
        return out

    def _emit(self, tracked: _Tracked) -> RequestOutput:
        """Snapshot the request; forget it once finished; reset the per-output deltas."""
        if tracked.request.is_finished:
            return self._finish_output(tracked)
        output = self._snapshot(tracked, finished=False)
        for out in tracked.outputs.values():
            out.new_token_ids, out.new_text, out.new_finish = [], "", False
        return output

    def _finish_output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        for seq in request.seqs:
            out = tracked.outputs.get(seq.seq_id) or self._new_completion(tracked, seq)
            text = tracked.texts[seq.seq_id]
            out.new_text += text.flush()  # an aborted sequence's held-back text too
            out.text = text.text
            if out.finish_reason is None:
                out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
                out.new_finish = True
        tracked.metrics.finished_time = time.monotonic()
        self._tracked.pop(request.request_id, None)
        self._owing.pop(request.seqs[0].seq_id, None)
        for seq in request.seqs:
            self._seq_request.pop(seq.seq_id, None)
        return self._snapshot(tracked, finished=True)

    def _snapshot(self, tracked: _Tracked, finished: bool) -> RequestOutput:
        request = tracked.request
        outputs = [
            _copy_completion(tracked.outputs[s.seq_id])
            for s in request.seqs
            if s.seq_id in tracked.outputs
        ]
        scored = tracked.prompt_logprobs
        return RequestOutput(
            request_id=request.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=list(request.seqs[0].prompt_ids),
            outputs=sorted(outputs, key=lambda o: o.index),
            finished=finished,
            metrics=RequestMetrics(**vars(tracked.metrics)),
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            prompt_logprobs=scored.entries if scored and scored.complete else None,  # final
        )


def _visible_ids(seq: Sequence, new_ids: list[int]) -> list[int]:
    """The new ids that make text: all but a stop token (EOS or a stop token id) that just
    ended the sequence, whose text is left out unless include_stop_str_in_output, as vLLM
    leaves it out."""
    stopped_by_token = seq.status is SequenceStatus.FINISHED_STOPPED and not isinstance(
        seq.stop_reason, str
    )
    if stopped_by_token and new_ids and not seq.params.include_stop_str_in_output:
        return new_ids[:-1]
    return new_ids


def _find_seq(request: Request, seq_id: str) -> Sequence:
    for seq in request.seqs:
        if seq.seq_id == seq_id:
            return seq
    raise AssertionError(f"sequence {seq_id} not in request {request.request_id}")


def _copy_completion(out: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        index=out.index,
        text=out.text,
        token_ids=list(out.token_ids),
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        logprobs=None if out.logprobs is None else list(out.logprobs),
        cumulative_logprob=out.cumulative_logprob,
        new_token_ids=list(out.new_token_ids),
        new_text=out.new_text,
        new_finish=out.new_finish,
        token_times=list(out.token_times),
    )
