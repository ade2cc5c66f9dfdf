"""A real in-test gRPC worker peer (Prefill/Decode/Colocated services over loopback).

It keeps block sets in a dict, so tests can see exactly what a worker holds and what the control
plane released. Blocks are freed only by Release or by finishing a stream, never by a cancelled
call, so tests observe the control plane's own cleanup. `port` binds a chosen port (a worker
restarted on its `--port`). Knobs: `gate` (Decode/Generate wait for it before their first
response), `after_first_gate`, `prefill_gate`, `reserve_gate` (Reserve waits for it before it
answers; `reserve_started` is set on its arrival), `reserve_error`, `tokens`
(responses after the first token), `pace` (seconds between them), `text` (of each of them),
`cached_tokens` (on the last one), `jitter` (each call first sleeps up to this many seconds,
drawn from `rng`, so cancels land at random points), `release_delay` (seconds each Release
takes), `tokenless_first` (the first response carries text but no token ids, as a worker's
prompt-only answer does); `sent` counts the responses streamed.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator

import grpc
from cp_fixtures import layout, worker_info

from kvmesh.security import Security
from kvmesh.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

_EPOCHS = itertools.count(101)
VOCAB = 256
LENGTH = generation_pb2.FINISH_REASON_LENGTH
UNFINISHED = generation_pb2.FINISH_REASON_UNSPECIFIED


LEASE_SECONDS = 10.0
_LANDED: dict[str, asyncio.Event] = {}  # transfer id -> the fake KV (and first token) landed


def landed(transfer_id: str) -> asyncio.Event:
    """The event a fake Prefill sets when its transfer's final frame reached the decode side."""
    return _LANDED.setdefault(transfer_id, asyncio.Event())


class FakeWorker(
    worker_pb2_grpc.PrefillServiceServicer,
    worker_pb2_grpc.DecodeServiceServicer,
    worker_pb2_grpc.ColocatedServiceServicer,
):
    def __init__(
        self,
        worker_id: str,
        role: str,
        *,
        num_blocks: int = 64,
        block_size: int = 16,
        security: Security | None = None,
        port: int = 0,
    ) -> None:
        self.worker_id, self.role = worker_id, role
        self.port = port
        self.security = security or Security()  # token required, TLS served, as a real worker
        self.epoch = next(_EPOCHS)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.held: dict[str, worker_pb2.HeldBlockSet] = {}
        self.reserved: dict[str, worker_pb2.EngineRequest] = {}
        self.released: list[tuple[str, int]] = []
        self.calls: list[str] = []
        self.metadata: list[dict[str, str]] = []
        self.gate: asyncio.Event | None = None
        self.after_first_gate: asyncio.Event | None = None
        self.prefill_gate: asyncio.Event | None = None
        self.reserve_gate: asyncio.Event | None = None
        self.reserve_started = asyncio.Event()
        self.stream_started = asyncio.Event()
        self.prefill_started = asyncio.Event()
        self.changed = asyncio.Event()
        self.reserve_error: grpc.StatusCode | None = None
        self.prepare_gate: asyncio.Event | None = None  # Prepare waits for it, then answers
        self.prepare_started = asyncio.Event()
        self.prepare_error: grpc.StatusCode | None = None
        self.tokens = 3
        self.finish_reason = LENGTH  # of the last response
        self.pace = 0.0  # seconds between the responses after the first
        self.text = "b"  # of each response after the first
        self.cached_tokens = 0  # on the last response
        self.sent = 0  # responses streamed (Decode and Generate)
        self.jitter = 0.0
        self.release_delay = 0.0  # seconds each Release takes to answer
        self.tokenless_first = False  # the first response: text without token ids
        self.rng = random.Random(0)
        self.address = ""
        self._server: grpc.aio.Server | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> FakeWorker:
        server = grpc.aio.server(interceptors=self.security.internal_interceptors())
        worker_pb2_grpc.add_PrefillServiceServicer_to_server(self, server)
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(self, server)
        worker_pb2_grpc.add_ColocatedServiceServicer_to_server(self, server)
        port = self.security.add_port(server, f"127.0.0.1:{self.port}")
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"
        return self

    async def kill(self) -> None:
        """Stop at once: open calls fail, new connections are refused."""
        if self._server is not None:
            await self._server.stop(grace=None)

    def info(self, **overrides: object) -> worker_pb2.WorkerInfo:
        kwargs: dict[str, object] = {"epoch": self.epoch, "address": self.address}
        kwargs["kv_layout"] = layout(block_size=self.block_size)
        kwargs["num_blocks"] = self.num_blocks
        kwargs.update(overrides)
        return worker_info(self.worker_id, self.role, **kwargs)  # type: ignore[arg-type]

    def load(self) -> worker_pb2.WorkerLoad:
        used = sum(h.num_blocks for h in self.held.values())
        return worker_pb2.WorkerLoad(
            total_blocks=self.num_blocks, free_blocks=self.num_blocks - used, running=len(self.held)
        )

    async def register(self, control: worker_pb2_grpc.ControlServiceStub) -> None:
        request = worker_pb2.RegisterRequest(
            worker=self.info(), held=list(self.held.values()), load=self.load()
        )
        await control.Register(request, timeout=5)

    async def heartbeat(
        self, control: worker_pb2_grpc.ControlServiceStub
    ) -> worker_pb2.HeartbeatResponse:
        request = worker_pb2.HeartbeatRequest(
            worker_id=self.worker_id, epoch=self.epoch, load=self.load(),
            held=list(self.held.values()),
        )  # fmt: skip
        response = await control.Heartbeat(request, timeout=5)
        for request_id in response.release_request_ids:
            self._free(request_id, 0)
        return response

    async def keep_alive(self, control: worker_pb2_grpc.ControlServiceStub, every: float) -> None:
        """Heartbeat until cancelled (what a real worker's background loop does)."""
        while True:
            await self.heartbeat(control)
            await asyncio.sleep(every)

    def _hold(
        self, request_id: str, generation: int, state: worker_pb2.BlockSetState, blocks: int
    ) -> None:
        self.held[request_id] = worker_pb2.HeldBlockSet(
            request_id=request_id, state=state, num_blocks=blocks, generation=generation
        )
        self.changed.set()

    def _free(self, request_id: str, generation: int) -> bool:
        held = self.held.get(request_id)
        if held is None or (generation and held.generation != generation):
            return False
        del self.held[request_id]
        self.released.append((request_id, held.generation))
        self.changed.set()
        return True

    async def wait_empty(self, timeout: float = 1.0) -> None:
        async def empty() -> None:
            while self.held:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(empty(), timeout)

    def _record(self, name: str, context: grpc.aio.ServicerContext) -> None:
        self.calls.append(name)
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})

    async def _pause(self) -> None:
        if self.jitter:
            await asyncio.sleep(self.rng.uniform(0, self.jitter))

    # -- PrefillService --------------------------------------------------------------------

    async def Prepare(
        self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareResponse:
        self._record("Prepare", context)
        self.prepare_started.set()
        if self.prepare_gate is not None:
            await self.prepare_gate.wait()
        if self.prepare_error is not None:
            await context.abort(self.prepare_error, "draining")
        await self._pause()
        engine = await self._prepare(request.request, context)
        return worker_pb2.PrepareResponse(request=engine)

    async def _prepare(
        self, req: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.EngineRequest:
        ids = list(req.token_ids.ids)
        if req.HasField("text"):
            ids = list(req.text.encode())
        elif req.HasField("chat"):  # a template-free rendering: the contents' bytes
            ids = list("".join(m.content for m in req.chat.messages).encode())
        engine = worker_pb2.EngineRequest(
            request_id=req.request_id, prompt_ids=ids, sampling=req.sampling,
            cache_salt=req.cache_salt,
        )  # fmt: skip
        await self._check(engine, context)
        return engine

    @staticmethod
    async def _check(engine: worker_pb2.EngineRequest, context: grpc.aio.ServicerContext) -> None:
        """INVALID_ARGUMENT as a real worker answers a prompt it cannot run."""
        if not engine.prompt_ids:  # nothing to condition the first token on
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: no tokens")
        for i, token in enumerate(engine.prompt_ids):
            if not 0 <= token < VOCAB:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"token_ids.ids[{i}] = {token} is outside [0, {VOCAB})",
                )

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        self._record("Prefill", context)
        req, target = request.request, request.target
        self._hold(req.request_id, target.generation, worker_pb2.BLOCK_SET_STATE_FILLING, 0)
        return await self._prefill(req, target)

    async def PrefillAhead(
        self,
        requests: AsyncIterator[worker_pb2.PrefillRequest],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PrefillResponse:
        """As a real prefill worker: holds from the first message, ships after the second."""
        self._record("PrefillAhead", context)
        messages = aiter(requests)
        start = await anext(messages)
        req = start.request
        if start.HasField("prompt"):
            req = await self._prepare(start.prompt, context)
        else:
            await self._check(req, context)
        self._hold(req.request_id, start.generation, worker_pb2.BLOCK_SET_STATE_FILLING, 0)
        second = await anext(messages, None)
        if second is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target: none")
        return await self._prefill(req, second.target)

    async def _prefill(
        self, req: worker_pb2.EngineRequest, target: worker_pb2.KVTarget
    ) -> worker_pb2.PrefillResponse:
        blocks = len(target.block_ids)
        self.held[req.request_id].num_blocks = blocks
        self.prefill_started.set()
        await self._pause()
        if self.prefill_gate is not None:
            await self.prefill_gate.wait()
        self._free(req.request_id, target.generation)  # acknowledged by the decode side
        landed(target.transfer_id).set()  # the final frame, with the first token
        first = worker_pb2.FirstToken(index=0, token_id=req.prompt_ids[-1])
        return worker_pb2.PrefillResponse(
            first_tokens=[first], cached_tokens=0, queue_seconds=0.001,
            prefill_seconds=0.002, transfer_seconds=0.003, transfer_bytes=blocks * 1024,
        )  # fmt: skip

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        self._record("Release", context)
        await asyncio.sleep(self.release_delay)
        return worker_pb2.ReleaseResponse(
            released=self._free(request.request_id, request.generation)
        )

    # -- DecodeService ---------------------------------------------------------------------

    async def Reserve(
        self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        self._record("Reserve", context)
        self.reserve_started.set()
        if self.reserve_gate is not None:
            await self.reserve_gate.wait()
        if self.reserve_error is not None:
            await context.abort(self.reserve_error, "no free KV blocks")
        req = request.request
        if request.HasField("prompt"):  # as a real decode worker: it prepares the prompt
            req = await self._prepare(request.prompt, context)
        else:
            await self._check(req, context)
        blocks = -(-len(req.prompt_ids) // self.block_size)
        self._hold(req.request_id, request.generation, worker_pb2.BLOCK_SET_STATE_RESERVED, blocks)
        self.reserved[req.request_id] = req
        await self._pause()
        return worker_pb2.ReserveResponse(
            block_ids=list(range(blocks)), transfer_id=f"t-{req.request_id}-{request.generation}",
            epoch=self.epoch, layout=layout(block_size=self.block_size), request=req,
        )  # fmt: skip

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        self._record("Decode", context)
        # Opened while the prefill runs: the first token comes with the KV.
        await asyncio.wait_for(landed(request.transfer_id).wait(), LEASE_SECONDS)
        first = [self.reserved[request.request_id].prompt_ids[-1]]
        held = self.held[request.request_id]
        held.state = worker_pb2.BLOCK_SET_STATE_DECODING
        async for response in self._tokens(first, request.request_id, request.generation):
            yield response

    async def Generate(
        self, message: worker_pb2.ColocatedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        self._record("Generate", context)
        request = message.request
        if message.HasField("prompt"):  # as a real colocated worker: it prepares the prompt
            request = await self._prepare(message.prompt, context)
        else:
            await self._check(request, context)
        self._hold(request.request_id, 0, worker_pb2.BLOCK_SET_STATE_DECODING, 1)
        prompt_tokens = len(request.prompt_ids)
        async for response in self._tokens([request.prompt_ids[-1]], request.request_id, 0):
            response.queue_seconds, response.prefill_seconds = 0.004, 0.005
            response.prompt_tokens, prompt_tokens = prompt_tokens, 0
            yield response

    async def _tokens(
        self, first: list[int], request_id: str, generation: int
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        self.stream_started.set()
        if self.gate is not None:
            await self.gate.wait()
        self.sent += 1
        yield worker_pb2.DecodeResponse(
            index=0, token_ids=[] if self.tokenless_first else first, text="a",
            first_decode_seconds=0.01,
        )  # fmt: skip
        if self.after_first_gate is not None:
            await self.after_first_gate.wait()
        for i in range(self.tokens):
            await self._pause()
            if self.pace:
                await asyncio.sleep(self.pace)
            last = i == self.tokens - 1
            self.sent += 1
            yield worker_pb2.DecodeResponse(
                index=0, token_ids=[i], text=self.text,
                finish_reason=self.finish_reason if last else UNFINISHED,
                completion_tokens=self.tokens + 1 if last else 0,
                cached_tokens=self.cached_tokens if last else 0,
            )  # fmt: skip
        self._free(request_id, generation)
