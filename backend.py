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
import importlib.metadata
import inspect
import json
import logging
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

import backend_pb2
import backend_pb2_grpc
from chat_output import Delta, OutputOptions, merge_deltas
from engine import (
    EmbeddingRequest,
    Engine,
    Finished,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    ScoreRequest,
    TokenLogprob,
)
from python_utils import (
    FAST_BLAS_ENV,
    FAST_BLAS_INSTALL,
    Aborted,
    BackendError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TemplateArgs,
    Unimplemented,
    check_sampling,
    convert_messages,
    encode_prompt,
    fast_blas_in_use,
    find_fast_blas,
    parse_duration,
    parse_forced_tokens,
    parse_logit_bias,
    parse_logprobs,
    parse_options,
    parse_template_args,
    parse_tool_choice,
    parse_tools,
    preload_environment,
    render_chat,
    render_sample_chat,
    switched_off,
)

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 50 * 1024 * 1024
# Status messages can quote a request's input; gRPC may refuse metadata over 8 KiB, and
# percent-encodes each byte of a non-ASCII character (up to 12 bytes a character).
MAX_STATUS_CHARS = 500
SERVICE_NAME = backend_pb2.DESCRIPTOR.services_by_name["Backend"].full_name
AUTH_TOKEN_ENV = "LOCALAI_GRPC_AUTH_TOKEN"
PARENT_WATCH_ENV = "LOCALAI_BACKEND_PARENT_WATCH"
PARENT_WATCH_INTERVAL_ENV = "LOCALAI_BACKEND_PARENT_WATCH_INTERVAL"
LOG_LEVEL_ENV = "MLX_BACKEND_LOG_LEVEL"
DEFAULT_MODEL_REF = "default"

_STATUS_CODES = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    Aborted: grpc.StatusCode.ABORTED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
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


def _pick(requested, default, fallback):
    """A request field overrides the LoadModel option; proto3's zero means unset."""
    if requested:
        return requested
    return fallback if default is None else default


# The PredictOptions field of each checked sampling value.
SAMPLING_FIELDS = {
    "temperature": "Temperature",
    "top_p": "TopP",
    "min_p": "MinP",
    "repetition_penalty": "Penalty",
    "frequency_penalty": "FrequencyPenalty",
    "presence_penalty": "PresencePenalty",
}


def parse_sampling(request, info: ModelInfo) -> SamplingParams:
    opts = info.options
    values = {
        name: _pick(
            check_sampling(field, name, getattr(request, field)),
            getattr(opts, name),
            0.0,
        )
        for name, field in SAMPLING_FIELDS.items()
    }
    if request.TopK < 0:
        raise InvalidArgument("TopK must not be negative")
    top_k = _pick(request.TopK, opts.top_k, 0)
    return SamplingParams(
        **values,
        # Keeping the whole vocabulary or more filters nothing.
        top_k=top_k if top_k < info.vocab_size else 0,
        repetition_context_size=opts.repetition_context_size,
        seed=request.Seed if request.Seed >= 0 else None,
        logit_bias=parse_logit_bias(request.LogitBias, info.vocab_size),
    )


def is_chat(request) -> bool:
    return bool(request.UseTokenizerTemplate and request.Messages)


def parse_prompt(request, info: ModelInfo) -> tuple[list[int], TemplateArgs]:
    """Prompt token ids (the chat template over ``Messages``, or ``Prompt`` as given),
    and the template arguments (of a raw prompt: only its tools)."""
    if is_chat(request):
        args = parse_template_args(
            request.Tools,
            request.ToolChoice,
            dict(request.Metadata),
            info.options.enable_thinking,
        )
        messages = convert_messages(request.Messages)
        return render_chat(info.tokenizer, messages, args), args
    # Malformed Tools is refused whatever the prompt.
    tools = parse_tools(request.Tools)
    return encode_prompt(info.tokenizer, request.Prompt), TemplateArgs(tools=tools)


def parse_output(
    request, info: ModelInfo, prompt: list[int], args: TemplateArgs
) -> OutputOptions:
    """How the reply is classified, as the model marks it up: chat requests, and raw
    prompts (LocalAI's Go templates) that carry Tools or end inside thinking."""
    tokenizer = info.tokenizer
    # A prompt that opens the assistant turn inside thinking ends there.
    opened = tokenizer.has_thinking and tokenizer.rfind_think_start(
        prompt
    ) > tokenizer.rfind_think_end(prompt)
    if not is_chat(request) and not args.tools and not opened:
        return OutputOptions()  # a plain completion: raw text
    return OutputOptions(
        classify=True,
        reasoning_open=opened,
        parse_tool_calls=parse_tool_choice(request.ToolChoice) != "none",
        tools=args.tools,
    )


def parse_forcing(request, info: ModelInfo) -> tuple[int, ...] | None:
    text = request.Metadata.get("forced_tokens")
    if text is None:
        return None
    if not info.options.forced_tokens:
        raise FailedPrecondition(
            "Metadata.forced_tokens needs the forced_tokens:true load option"
        )
    return parse_forced_tokens(text, info.vocab_size)


def parse_generation(request, info: ModelInfo) -> GenerationRequest:
    """Parse ``PredictOptions`` once into the engine's request type."""
    sampling = parse_sampling(request, info)
    forced = parse_forcing(request, info)
    prompt, args = parse_prompt(request, info)
    if not prompt:
        raise InvalidArgument("Prompt: the prompt is empty (set Prompt or Messages)")
    room = info.context_size - len(prompt)
    if room <= 0:
        raise InvalidArgument(
            f"Prompt: the prompt has {len(prompt)} tokens, which does not fit the "
            f"context size of {info.context_size} tokens"
        )
    limit = request.Tokens if request.Tokens > 0 else info.options.max_tokens
    return GenerationRequest(
        prompt=tuple(prompt),
        max_tokens=min(limit or room, room),
        sampling=sampling,
        stop=tuple(s for s in request.StopPrompts if s),
        ignore_eos=request.IgnoreEOS,
        output=parse_output(request, info, prompt, args),
        forced_tokens=forced,
        logprobs=parse_logprobs(request.Logprobs, request.TopLogprobs),
        grammar=info.grammars.compile(request.Grammar) if request.Grammar else None,
        model_generation=info.generation,
    )


def _check_tokens(field: str, tokens: Iterable[int], info: ModelInfo) -> None:
    for i, token in enumerate(tokens):
        if not 0 <= token < info.vocab_size:
            raise InvalidArgument(
                f"{field}[{i}]: {token} is outside the vocabulary "
                f"(0..{info.vocab_size - 1})"
            )


def _check_fits(field: str, length: int, info: ModelInfo) -> None:
    if length > info.context_size:
        raise InvalidArgument(
            f"{field}: {length} tokens do not fit the context size of "
            f"{info.context_size} tokens"
        )


def parse_embedding(request, info: ModelInfo) -> EmbeddingRequest:
    """The tokens to embed: ``EmbeddingTokens`` as given, or ``Embeddings`` encoded."""
    if not info.embeddings:
        raise FailedPrecondition(
            "Embedding: this model's architecture does not expose its hidden states"
        )
    if request.EmbeddingTokens:
        tokens = list(request.EmbeddingTokens)
        _check_tokens("EmbeddingTokens", tokens, info)
        field = "EmbeddingTokens"
    else:
        # Checked before encoding: a tokenizer that adds BOS never gives nothing.
        text = request.Embeddings
        tokens = encode_prompt(info.tokenizer, text) if text else []
        field = "Embeddings"
    if not tokens:
        raise InvalidArgument(
            "Embeddings: the input is empty (set Embeddings or EmbeddingTokens)"
        )
    _check_fits(field, len(tokens), info)
    return EmbeddingRequest(tokens=tuple(tokens), model_generation=info.generation)


def parse_score(request, info: ModelInfo) -> ScoreRequest:
    """The prompt's tokens, and each candidate's, encoded without special tokens."""
    if not request.candidates:
        raise InvalidArgument("candidates: the list is empty")
    for i, candidate in enumerate(request.candidates):
        if not candidate:
            raise InvalidArgument(f"candidates[{i}]: the candidate is empty")
    if not request.prompt:
        raise InvalidArgument("prompt: the prompt is empty")
    prompt = encode_prompt(info.tokenizer, request.prompt)
    candidates = []
    for i, candidate in enumerate(request.candidates):
        tokens = info.tokenizer.encode(candidate, add_special_tokens=False)
        if not tokens:
            raise InvalidArgument(f"candidates[{i}]: the candidate has no tokens")
        _check_fits(f"candidates[{i}]", len(prompt) + len(tokens), info)
        candidates.append(tuple(tokens))
    return ScoreRequest(
        prompt=tuple(prompt),
        candidates=tuple(candidates),
        model_generation=info.generation,
    )


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

    async def _generate(self, request, context) -> AsyncIterator:
        info = self._model(request.ModelIdentity)
        parsed = await asyncio.to_thread(parse_generation, request, info)
        stream = self.engine.submit(parsed, asyncio.get_running_loop())
        try:
            async for event in stream:
                yield event
        finally:
            # Also reached when the client cancels: the engine drops the sequence.
            stream.cancel()

    async def load(self, request) -> backend_pb2.Result:
        try:
            options = parse_options(request.Options)
        except BackendError as e:
            return backend_pb2.Result(success=False, message=str(e))
        model = "" if request.Model == DEFAULT_MODEL_REF else request.Model
        future = self.engine.load(
            model,
            options,
            request.ContextSize,
            identity=request.Model,
            model_file=request.ModelFile,
            model_path=request.ModelPath,
            adapter=request.LoraAdapter or None,
        )
        try:
            info = await asyncio.wrap_future(future)
        except Exception as e:
            kept = self.engine.info
            serving = (
                f"; still serving {kept.source}" if kept else "; no model is loaded"
            )
            logger.warning("LoadModel failed: %s%s", e, serving)
            return backend_pb2.Result(
                success=False, message=f"LoadModel failed: {e}{serving}"
            )
        logger.info("model loaded from %s, context %d", info.source, info.context_size)
        return backend_pb2.Result(
            success=True,
            message=f"loaded {info.source} (context size {info.context_size}; "
            f"{info.compute_path.description})",
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
        _check_tokens("tokens", request.tokens, info)
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
        vector = await asyncio.wrap_future(self.engine.compute(parsed))
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
        scores = await asyncio.wrap_future(self.engine.compute(parsed))
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
    async def GetMetrics(self, request, context):
        metrics = self.engine.last_metrics
        return backend_pb2.MetricsResponse(
            slot_id=metrics.slot_id,
            tokens_per_second=metrics.tokens_per_second,
            tokens_generated=metrics.tokens_generated,
            prompt_tokens_processed=metrics.prompt_tokens_processed,
        )

    @grpc_errors
    async def ModelMetadata(self, request, context):
        info = self._model()
        markers = info.markers
        rendered = await asyncio.to_thread(render_sample_chat, info.tokenizer)
        return backend_pb2.ModelMetadataResponse(
            supports_thinking=markers.think_start is not None,
            rendered_template=rendered,
            tool_format=backend_pb2.ToolFormatMarkers(
                format_type=markers.tool_format or "",
                section_start=markers.tool_call_start or "",
                section_end=markers.tool_call_end or "",
                reasoning_start=markers.think_start or "",
                reasoning_end=markers.think_end or "",
            ),
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


async def serve(address: str, model: str | None, grace: float = 5.0) -> None:
    engine = Engine()
    servicer = BackendServicer(engine)
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
    await asyncio.to_thread(engine.shutdown)
    logger.info("stopped")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def maybe_reexec_with_fast_blas() -> None:
    """On Linux CPU, restart once with a fast BLAS preloaded in place of MLX's own.

    MLX binds its BLAS at load time, so the choice has to be made before it
    loads. ``MLX_BACKEND_FAST_BLAS`` picks it: ``auto`` (default: MKL, then
    OpenBLAS), ``mkl``, ``openblas``, a library path, or ``off`` for the bundled
    reference BLAS.
    """
    if sys.platform != "linux" or switched_off(os.environ, FAST_BLAS_ENV):
        return
    if fast_blas_in_use(os.environ):
        return  # already restarted with it
    if (
        not _installed("mlx-cpu")
        or _installed("mlx-cuda-12")
        or _installed("mlx-cuda-13")
    ):
        return  # CUDA builds do their matmuls on the GPU
    choice = os.environ.get(FAST_BLAS_ENV, "auto")
    try:
        library = find_fast_blas(choice)
    except ValueError as e:
        logger.warning("%s; using auto", e)
        library = find_fast_blas()
    if library is None:
        logger.warning(
            "no fast BLAS found for %s=%s: the CPU path stays slow. "
            "For full speed: %s (or 'make install' as root)",
            FAST_BLAS_ENV,
            choice,
            FAST_BLAS_INSTALL,
        )
        return
    logger.info("restarting with %s preloaded for MLX's matmuls", library)
    os.execve(
        sys.executable,
        [sys.executable, *sys.argv],
        preload_environment(os.environ, library),
    )


def main(argv: list[str] | None = None) -> None:
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
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if argv is None:
        maybe_reexec_with_fast_blas()
    asyncio.run(serve(args.addr, args.model))


if __name__ == "__main__":
    main()
