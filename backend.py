#!/usr/bin/env python3
"""LocalAI's MLX backend: the gRPC layer.

Requests are parsed into domain objects, handed to the engine thread, and its
events are turned back into protos. Domain errors are mapped to gRPC status
codes once, here.
"""

import argparse
import asyncio
import functools
import hmac
import inspect
import json
import logging
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence

from mlx_backend.cpu.preload import maybe_reexec_with_preloads

LOG_LEVEL_ENV = "MLX_BACKEND_LOG_LEVEL"


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


if __name__ == "__main__":
    # The restart with a fast BLAS comes before grpc, mlx-lm and transformers load:
    # after them, each start loaded them twice (1.2 s).
    configure_logging(os.environ.get(LOG_LEVEL_ENV, "INFO"))
    maybe_reexec_with_preloads()

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

import backend_pb2
import backend_pb2_grpc
from mlx_backend.distributed.follower import LOST, run_worker
from mlx_backend.distributed.group import launched_rank, worker_settings
from mlx_backend.engine.engine import Engine
from mlx_backend.errors import (
    Aborted,
    BackendError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from mlx_backend.formats.base import ChatFormat
from mlx_backend.gpu.cuda_graphs import configure_graph_cache
from mlx_backend.models.loading import DEFAULT_MODEL_REF, ModelInfo
from mlx_backend.output.chat_output import Delta, merge_deltas
from mlx_backend.output.reply_pipeline import Finished, TokenLogprob
from mlx_backend.refusals import describe_error, is_described
from mlx_backend.request_parsing import (
    ComputeRequest,
    GenerationRequest,
    check_tokens,
    parse_embedding,
    parse_generation,
    parse_load,
    parse_prompt,
    parse_rerank,
    parse_score,
)
from mlx_backend.switches import switched_off
from mlx_backend.training.export import export, parse_export
from mlx_backend.training.jobs import FineTuneJobs, list_checkpoints
from mlx_backend.training.plan import (
    BACKEND_NAME,
    checkpoints_folder,
    is_backend_name,
    parse_fine_tune,
)
from python_utils import LoadOptions, parse_duration, render_sample_chat

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 50 * 1024 * 1024
# Status messages can quote a request's input; gRPC may refuse metadata over 8 KiB, and
# percent-encodes each byte of a non-ASCII character (up to 12 bytes a character).
MAX_STATUS_CHARS = 500
SERVICE_NAME = backend_pb2.DESCRIPTOR.services_by_name["Backend"].full_name
AUTH_TOKEN_ENV = "LOCALAI_GRPC_AUTH_TOKEN"
PARENT_WATCH_ENV = "LOCALAI_BACKEND_PARENT_WATCH"
PARENT_WATCH_INTERVAL_ENV = "LOCALAI_BACKEND_PARENT_WATCH_INTERVAL"

_STATUS_CODES = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    Aborted: grpc.StatusCode.ABORTED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}

_STATUS_STATES = {
    "uninitialized": backend_pb2.StatusResponse.UNINITIALIZED,
    "loading": backend_pb2.StatusResponse.BUSY,
    "busy": backend_pb2.StatusResponse.BUSY,
    "ready": backend_pb2.StatusResponse.READY,
    "error": backend_pb2.StatusResponse.ERROR,
}


async def _abort(context: grpc.aio.ServicerContext, error: Exception):
    code = next((c for t, c in _STATUS_CODES.items() if isinstance(error, t)), None)
    if code is None:
        logger.error("internal error", exc_info=error)
        code, message = grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"
    else:
        message = str(error)
    if len(message) > MAX_STATUS_CHARS:
        # Past gRPC's metadata limit the client would see RESOURCE_EXHAUSTED instead.
        message = message[: MAX_STATUS_CHARS - 3] + "..."
    await context.abort(code, message)


def grpc_errors(method):
    """Translate exceptions raised by a handler into a gRPC status, once."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for reply in method(self, request, context):
                    yield reply
            except Exception as e:
                await _abort(context, e)

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as e:
            await _abort(context, e)

    return unary


def _finite(logprob: float) -> float:
    # JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0.
    return logprob if math.isfinite(logprob) else -9999.0


def _logprob_json(token: bytes, logprob: float) -> dict:
    return {
        "token": token.decode("utf-8", errors="replace"),
        "logprob": _finite(logprob),
        "bytes": list(token),
    }


def logprobs_json(entries: Sequence[TokenLogprob]) -> bytes:
    """``Reply.logprobs``: OpenAI's chat logprobs object, one entry per token."""
    if not entries:
        return b""
    content = [
        {
            **_logprob_json(entry.token, entry.logprob),
            "top_logprobs": [_logprob_json(t, v) for t, v in entry.top],
        }
        for entry in entries
    ]
    return json.dumps({"content": content}).encode()


def _reply(
    delta: Delta,
    logprobs: Sequence[TokenLogprob] = (),
    whole: bool = False,
    **fields,
) -> backend_pb2.Reply:
    """A Reply whose ``message`` is the visible content and whose delta is all of it.

    A stream leaves out empty deltas; ``whole`` (Predict) always carries one.
    """
    chat_delta = backend_pb2.ChatDelta(
        content=delta.content,
        reasoning_content=delta.reasoning,
        tool_calls=[
            backend_pb2.ToolCallDelta(
                index=call.index, id=call.id, name=call.name, arguments=call.arguments
            )
            for call in delta.tool_calls
        ],
    )
    return backend_pb2.Reply(
        message=delta.content.encode("utf-8"),
        chat_deltas=[chat_delta] if delta or whole else [],
        logprobs=logprobs_json(logprobs),
        **fields,
    )


def make_tool_format_markers(chat_format: ChatFormat) -> backend_pb2.ToolFormatMarkers:
    """ModelMetadata's view of the chat format: its name and its markers."""
    tools, think, channels = (
        chat_format.tools,
        chat_format.reasoning,
        chat_format.channels,
    )
    if channels is not None:
        think_markers = (
            f"{channels.channel}analysis{channels.message}",
            channels.ends[0],
        )
    else:
        think_markers = (think.start, think.end) if think else ("", "")
    return backend_pb2.ToolFormatMarkers(
        # Empty where the model has no tool-call format, as before formats existed.
        format_type=chat_format.name if tools or channels else "",
        section_start=tools.start if tools else "",
        section_end=tools.end if tools else "",
        reasoning_start=think_markers[0],
        reasoning_end=think_markers[1],
    )


def _final_reply(
    final: Finished, delta: Delta, logprobs: Sequence[TokenLogprob], whole: bool
) -> backend_pb2.Reply:
    return _reply(
        delta,
        logprobs,
        whole,
        tokens=final.completion_tokens,
        prompt_tokens=final.prompt_tokens,
        timing_prompt_processing=final.prompt_seconds * 1000.0,
        timing_token_generation=final.generation_seconds * 1000.0,
    )


class BackendServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self, engine: Engine):
        self.engine = engine
        self.fine_tunes = FineTuneJobs()
        engine.count_beside(self.fine_tunes.held_bytes)

    def _model(self, identity: str = "") -> ModelInfo:
        info = self.engine.info
        if info is None:
            raise FailedPrecondition("no model is loaded: call LoadModel first")
        if identity and info.name and identity != info.name:
            raise NotFound(
                f"model identity mismatch: the request is for {identity!r}, "
                f"this backend serves {info.name!r}"
            )
        return info

    def parse_generation(self, request, info: ModelInfo) -> GenerationRequest:
        """``PredictOptions`` parsed once into the engine's request type."""
        return parse_generation(request, info)

    async def _generate(self, request, context) -> AsyncIterator:
        info = self._model(request.ModelIdentity)
        parsed = await asyncio.to_thread(self.parse_generation, request, info)
        stream = self.engine.submit(parsed, asyncio.get_running_loop())
        try:
            async for event in stream:
                yield event
        finally:
            # Also reached when the client cancels: the engine drops the sequence.
            stream.cancel()

    async def _computed(self, request: ComputeRequest):
        future = self.engine.compute(request)
        try:
            return await asyncio.wrap_future(future)
        finally:
            # Also reached when the client cancels: the engine drops the work.
            if not future.done():
                self.engine.withdraw(future)

    async def load(self, request) -> backend_pb2.Result:
        if is_backend_name(request.Model, request.ModelPath):
            # LocalAI's fine-tuning service loads the backend by its own name first.
            return backend_pb2.Result(
                success=True, message=f"{BACKEND_NAME}: ready to fine-tune"
            )
        try:
            plan = parse_load(request)
        except BackendError as e:
            return backend_pb2.Result(success=False, message=str(e))
        future = self.engine.load(plan)
        try:
            info = await asyncio.wrap_future(future)
        except Exception as e:
            kept = self.engine.info
            serving = (
                f"; still serving {kept.source}" if kept else "; no model is loaded"
            )
            # Any path can be named: the reply describes files, never quotes them.
            why = describe_error(e)
            logger.warning(
                "LoadModel failed: %s%s", why, serving, exc_info=not is_described(e)
            )
            return backend_pb2.Result(
                success=False, message=f"LoadModel failed: {why}{serving}"
            )
        logger.info("model loaded from %s, context %d", info.source, info.context_size)
        return backend_pb2.Result(
            success=True,
            message=f"loaded {info.source} (context size {info.context_size}; "
            f"{info.compute_path.description}; chat format "
            f"{info.chat_format.description}; {info.cache_kinds.describe()})",
        )

    async def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    async def LoadModel(self, request, context):
        return await self.load(request)

    @grpc_errors
    async def Free(self, request, context):
        await asyncio.wrap_future(self.engine.free())
        return backend_pb2.Result(success=True, message="model freed")

    @grpc_errors
    async def Predict(self, request, context):
        deltas, logprobs = [], []
        async for event in self._generate(request, context):
            deltas.append(event.delta)
            logprobs += event.logprobs
        return _final_reply(event, merge_deltas(deltas), logprobs, whole=True)

    @grpc_errors
    async def PredictStream(self, request, context):
        async for event in self._generate(request, context):
            if isinstance(event, Finished):
                yield _final_reply(event, event.delta, event.logprobs, whole=False)
            else:
                yield _reply(event.delta, event.logprobs)

    @grpc_errors
    async def TokenizeString(self, request, context):
        info = self._model(request.ModelIdentity)
        tokens, _ = await asyncio.to_thread(parse_prompt, request, info)
        return backend_pb2.TokenizationResponse(length=len(tokens), tokens=tokens)

    @grpc_errors
    async def Detokenize(self, request, context):
        info = self._model()
        check_tokens("tokens", request.tokens, info)
        text = await asyncio.to_thread(info.tokenizer.decode, list(request.tokens))
        return backend_pb2.DetokenizeResponse(content=text)

    async def Status(self, request, context):
        stats = self.engine.stats
        return backend_pb2.StatusResponse(
            state=_STATUS_STATES[stats.state],
            memory=backend_pb2.MemoryUsageData(
                total=stats.memory.get("active", 0), breakdown=stats.memory
            ),
        )

    @grpc_errors
    async def Embedding(self, request, context):
        info = self._model(request.ModelIdentity)
        parsed = await asyncio.to_thread(parse_embedding, request, info)
        vector = await self._computed(parsed)
        return backend_pb2.EmbeddingResult(
            embeddings=vector,
            tokens=1,
            dim=len(vector),
            prompt_tokens=len(parsed.tokens),
            layout=backend_pb2.EMBEDDING_LAYOUT_FINAL,
        )

    @grpc_errors
    async def Score(self, request, context):
        info = self._model(request.ModelIdentity)
        parsed = await asyncio.to_thread(parse_score, request, info)
        scores = await self._computed(parsed)
        results = []
        for tokens, logprobs in zip(parsed.candidates, scores):
            total = sum(logprobs)
            results.append(
                backend_pb2.CandidateScore(
                    log_prob=total,
                    length_normalized_log_prob=(
                        total / len(tokens) if request.length_normalize else 0.0
                    ),
                    tokens=(
                        [
                            backend_pb2.TokenLogProb(
                                token=info.token_bytes.of(t).decode(
                                    "utf-8", errors="replace"
                                ),
                                log_prob=value,
                            )
                            for t, value in zip(tokens, logprobs)
                        ]
                        if request.include_token_logprobs
                        else []
                    ),
                    num_tokens=len(tokens),
                )
            )
        return backend_pb2.ScoreResponse(candidates=results)

    @grpc_errors
    async def Rerank(self, request, context):
        info = self._model(request.ModelIdentity)
        job = await asyncio.to_thread(parse_rerank, request, info)
        answers = await self._computed(job.judge)
        results = [
            backend_pb2.DocumentResult(
                index=index, text=job.texts[index], relevance_score=score
            )
            for index, score in job.ranked(answers)
        ]
        usage = backend_pb2.Usage(
            total_tokens=job.prompt_tokens, prompt_tokens=job.prompt_tokens
        )
        return backend_pb2.RerankResult(usage=usage, results=results)

    @grpc_errors
    async def GetMetrics(self, request, context):
        metrics = self.engine.last_metrics
        # The proto has no speculation fields: the counts travel as JSON here.
        speculation = {
            "draft_tokens_proposed": metrics.draft_tokens_proposed,
            "draft_tokens_accepted": metrics.draft_tokens_accepted,
        }
        return backend_pb2.MetricsResponse(
            slot_id=metrics.slot_id,
            prompt_json_for_slot=json.dumps(speculation),
            tokens_per_second=metrics.tokens_per_second,
            tokens_generated=metrics.tokens_generated,
            prompt_tokens_processed=metrics.prompt_tokens_processed,
        )

    @grpc_errors
    async def StartFineTune(self, request, context):
        plan = await asyncio.to_thread(parse_fine_tune, request)
        job = await asyncio.to_thread(self.fine_tunes.start, plan)
        return backend_pb2.FineTuneJobResult(
            job_id=job.plan.job_id,
            success=True,
            message=f"{plan.fine_tune_type} sft, {plan.iters} steps",
        )

    @grpc_errors
    async def FineTuneProgress(self, request, context):
        job = self.fine_tunes.get(request.job_id)
        seen = 0
        while True:
            updates, ended = await asyncio.to_thread(job.wait, seen, 1.0)
            seen += len(updates)
            for update in updates:
                yield backend_pb2.FineTuneProgressUpdate(
                    job_id=job.plan.job_id, **update
                )
            if ended and not updates:
                return

    @grpc_errors
    async def StopFineTune(self, request, context):
        self.fine_tunes.get(request.job_id).stop(request.save_checkpoint)
        return backend_pb2.Result(success=True, message="stopping after this step")

    @grpc_errors
    async def ListCheckpoints(self, request, context):
        folder = await asyncio.to_thread(checkpoints_folder, request.output_dir)
        found = await asyncio.to_thread(list_checkpoints, folder)
        return backend_pb2.ListCheckpointsResponse(
            checkpoints=[backend_pb2.CheckpointInfo(**c) for c in found]
        )

    @grpc_errors
    async def ExportModel(self, request, context):
        plan = await asyncio.to_thread(parse_export, request)
        try:
            wrote = await asyncio.to_thread(export, plan)
        except BackendError as e:
            return backend_pb2.Result(success=False, message=str(e))
        return backend_pb2.Result(success=True, message=f"wrote {wrote}")

    @grpc_errors
    async def ModelMetadata(self, request, context):
        info = self._model()
        chat_format = info.chat_format
        rendered = await asyncio.to_thread(render_sample_chat, info.tokenizer)
        return backend_pb2.ModelMetadataResponse(
            supports_thinking=bool(chat_format.reasoning or chat_format.channels),
            rendered_template=rendered,
            tool_format=make_tool_format_markers(chat_format),
        )


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every RPC without ``authorization: Bearer <token>``."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        supplied = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(supplied.encode(), self._expected) or handler is None:
            return handler
        return _refusing_handler(handler)


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request, context):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token"
        )

    async def refuse_stream(request, context):
        await refuse(request, context)
        yield  # an async generator, as streaming handlers are

    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, refuse),
        (False, True): (grpc.unary_stream_rpc_method_handler, refuse_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, refuse),
        (True, True): (grpc.stream_stream_rpc_method_handler, refuse_stream),
    }
    make, behaviour = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def create_server(
    servicer: BackendServicer, address: str, auth_token: str | None = None
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """A grpc.aio server with the Backend, health and reflection services."""
    interceptors = [BearerAuthInterceptor(auth_token)] if auth_token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    backend_pb2_grpc.add_BackendServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    return server, port, health


def parent_watch_interval() -> float | None:
    """Seconds between parent checks, or None when the watch is off."""
    if switched_off(os.environ, PARENT_WATCH_ENV):
        return None
    raw = os.environ.get(PARENT_WATCH_INTERVAL_ENV, "2s")
    try:
        return max(parse_duration(raw), 0.05)
    except ValueError:
        logger.warning("bad %s=%r, using 2s", PARENT_WATCH_INTERVAL_ENV, raw)
        return 2.0


async def watch_parent(interval: float, stop: asyncio.Event) -> None:
    parent = os.getppid()
    if parent == 1:
        logger.info("started by init: the parent watch is off")
        return
    while not stop.is_set():
        await asyncio.sleep(interval)
        current = os.getppid()
        if current != parent or current == 1:
            logger.warning("parent process %d is gone, shutting down", parent)
            stop.set()


async def serve(
    address: str,
    model: str | None,
    grace: float = 5.0,
    servicer_class: type[BackendServicer] = BackendServicer,
) -> None:
    engine = Engine()
    servicer = servicer_class(engine)
    server, port, health = create_server(
        servicer, address, os.environ.get(AUTH_TOKEN_ENV) or None
    )
    await server.start()
    host = address.rsplit(":", 1)[0]
    logger.info("listening on %s:%d (pid %d)", host, port, os.getpid())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    interval = parent_watch_interval()
    watcher = asyncio.create_task(watch_parent(interval, stop)) if interval else None

    if model is not None:
        result = await servicer.load(backend_pb2.ModelOptions(Model=model))
        logger.info("startup model: %s", result.message)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    await stop.wait()
    logger.info("shutting down")
    if watcher:
        watcher.cancel()
    await health.enter_graceful_shutdown()
    await server.stop(grace)
    await asyncio.to_thread(servicer.fine_tunes.close)
    await asyncio.to_thread(engine.shutdown)
    logger.info("stopped")


def main(
    argv: list[str] | None = None,
    servicer_class: type[BackendServicer] = BackendServicer,
) -> None:
    parser = argparse.ArgumentParser(description="LocalAI MLX backend (gRPC)")
    parser.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT to bind")
    parser.add_argument(
        "--model",
        default=None,
        help=f"load this model at startup ('{DEFAULT_MODEL_REF}' for the embedded one)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get(LOG_LEVEL_ENV, "INFO"),
        help=f"logging level (env {LOG_LEVEL_ENV})",
    )
    workers = parser.add_argument_group(
        "distributed workers (ranks 1 and up; rank 0 is the gRPC server)"
    )
    workers.add_argument(
        "--worker", action="store_true", help="follow rank 0 instead of serving"
    )
    workers.add_argument("--hostfile", default="", help="MLX's hostfile JSON")
    workers.add_argument("--rank", type=int, default=None, help="this worker's rank")
    workers.add_argument("--backend", default="", help="ring (default), jaccl or mpi")
    workers.add_argument(
        "--coordinator", default="", help="IP:PORT of the JACCL coordinator"
    )
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    # Before MLX's first GPU evaluation, which reads these; LoadModel can't resize.
    configure_graph_cache(os.environ, LoadOptions().max_batch_size)
    if argv is None:
        # A module that runs main() without backend.py's early restart.
        maybe_reexec_with_preloads()
    # Under mlx.launch every rank runs this command: ranks 1 and up follow rank 0.
    launched = launched_rank(os.environ)
    if args.worker or (launched is not None and launched > 0):
        try:
            settings = worker_settings(
                args.hostfile, args.rank, args.backend, args.coordinator, os.environ
            )
        except BackendError as e:
            parser.error(str(e))
        status = run_worker(settings)
        if status == LOST and args.worker:
            # LocalAI restarts a lost rank 0; its MLX group can only be joined
            # by a fresh process.
            logger.info("waiting for rank 0 to come back")
            os.execv(sys.executable, [sys.executable, *sys.argv])
        sys.exit(status)
    asyncio.run(serve(args.addr, args.model, servicer_class=servicer_class))


if __name__ == "__main__":
    main()
