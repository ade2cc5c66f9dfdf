"""What one finished request adds to the control plane's metrics."""

from __future__ import annotations

import grpc

from control_plane.metrics import ControlMetrics
from control_plane.run import Run
from kvmesh.v1 import generation_pb2

PHASES = ("queue", "prefill", "transfer", "first_decode")  # Timings field = label


def finish_reason_label(reason: int) -> str:
    """`stop`, `length` or `abort` (vLLM's finished_reason values)."""
    name: str = generation_pb2.FinishReason.Name(reason)
    return name.removeprefix("FINISH_REASON_").lower()


def record_run(metrics: ControlMetrics, run: Run, status: grpc.StatusCode, model: str) -> None:
    """Count the request by status, its tokens whatever the status; latencies of OK runs
    whose first token was relayed, each ending at the last token relayed (the cleanup that
    follows, the Releases, is not the client's wait). With no model (refused while no worker
    was live: it reached none, so it has no tokens and no latencies) only its status counts:
    no `model_name=""` series."""
    metrics.requests.labels(status.name).inc()
    if not model:
        return
    m, t = metrics.request, run.timings
    if t.prompt_tokens:
        m.prompt_tokens.labels(model).inc(t.prompt_tokens)
    m.generation_tokens.labels(model).inc(run.tokens_streamed)
    if status != grpc.StatusCode.OK or t.ttft is None:
        return
    e2e = max(run.tokens.last.values(), default=run.clock()) - run.arrival
    m.ttft.labels(model).observe(t.ttft)
    m.e2e.labels(model).observe(e2e)
    m.queue.labels(model).observe(t.queue)
    m.prefill.labels(model).observe(t.prefill)
    m.decode.labels(model).observe(max(0.0, e2e - t.ttft))
    m.prompt_length.labels(model).observe(t.prompt_tokens)
    m.generation_length.labels(model).observe(run.tokens_streamed)
    for gap in run.tokens.gaps:
        m.inter_token.labels(model).observe(gap)
    for seconds in run.tokens.per_output_token():
        m.tpot.labels(model).observe(seconds)
    reason = run.tokens.finish_reasons.get(0, generation_pb2.FINISH_REASON_UNSPECIFIED)
    m.success.labels(model, finish_reason_label(reason)).inc()
    for phase in PHASES:
        metrics.ttft_phase.labels(phase).observe(getattr(t, phase))
