"""Helpers for tests of the engine and its decoders: an in-process engine loaded
with load options (``load_engine``), generation requests for it, its events run
and collected, its stats once idle and calls on its thread; a decoder driven by
hand (``drive``) and two such decodes compared (``assert_greedy_close``); and the float64 log-softmax that logprobs are checked against.
"""

import asyncio

import numpy as np
import pytest
from mlx_lm.sample_utils import greedy_sampler

from mlx_backend.decoders.base import NewSequence
from mlx_backend.engine.engine import Engine
from mlx_backend.models.loading import LoadPlan
from mlx_backend.output.chat_output import merge_deltas
from mlx_backend.request_parsing import GenerationRequest
from mlx_utils import make_kv_cache
from python_utils import parse_options
from tests.support import QUESTION


def load_engine(
    *options: str, draft: str = "", model: str = "", model_path: str = ""
) -> Engine:
    """An engine serving ``model`` (a folder; "" is the embedded default), whose
    model folder (LocalAI's ModelPath) is ``model_path``."""
    engine = Engine()
    plan = LoadPlan(
        model=model,
        identity=model or "default",
        model_path=model_path,
        draft=draft,
        options=parse_options(list(options)),
    )
    engine.load(plan).result()
    return engine


def chat_prompt(engine: Engine, text: str = QUESTION) -> tuple[int, ...]:
    messages = [{"role": "user", "content": text}]
    tokenizer = engine.info.tokenizer
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def generation(engine: Engine, text: str = QUESTION, **fields) -> GenerationRequest:
    fields.setdefault("max_tokens", 32)
    return GenerationRequest(
        prompt=chat_prompt(engine, text),
        load_id=engine.info.load_id,
        **fields,
    )


async def collect(engine: Engine, parsed: GenerationRequest) -> list:
    """Every event of one generation; an error ends the list instead of raising."""
    events = []
    try:
        async for event in engine.submit(parsed, asyncio.get_running_loop()):
            events.append(event)
    except Exception as e:
        events.append(e)
    return events


def run(engine: Engine, *requests: GenerationRequest) -> list[list]:
    """The requests' events, submitted together so that they share steps."""

    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    return asyncio.run(main())


def text_of(events: list) -> str:
    return merge_deltas(e.delta for e in events).content


def wait_idle(engine: Engine, turns: int = 200) -> None:
    """Until the engine thread has retired every sequence (each call is a turn)."""
    for _ in range(turns):
        engine.call(lambda: None).result(60)
        if engine.stats.active == 0:
            return
    raise AssertionError(f"{engine.stats.active} sequences still active")


def stats_after(engine: Engine) -> dict[str, int]:
    """Status figures once every sequence is retired."""
    wait_idle(engine)
    return engine.stats.memory


def on_engine_thread(engine: Engine, fn):
    """``fn(model, options)`` on the engine thread, which owns the MLX objects."""
    return engine.call(lambda: fn(engine.served.model, engine.info.options)).result()


def new_sequence(
    model, options, prompt, max_tokens: int, logprobs: int | None = None
) -> NewSequence:
    """A greedy sequence with a fresh KV cache, for a decoder driven by hand."""
    return NewSequence(
        prompt=prompt,
        rest=prompt,
        kv_cache=make_kv_cache(model, options),
        sampler=greedy_sampler,
        processors=[],
        max_tokens=max_tokens,
        logprobs=logprobs,
    )


def drive(
    decoder, model, options, prompts, max_tokens: int, logprobs: int | None
) -> dict:
    """Each prompt's greedy tokens, logprob entries and final KV state."""
    keys = [
        decoder.add(new_sequence(model, options, prompt, max_tokens, logprobs))
        for prompt in prompts
    ]
    out = {key: ([], [], None) for key in keys}
    pending = set(keys)
    while pending:
        for result in decoder.step():
            assert result.error is None
            tokens, scores, _ = out[result.key]
            tokens += result.tokens
            scores += result.logprobs
            if result.done:
                pending.discard(result.key)
                state = result.state or decoder.remove(result.key)
                out[result.key] = (tokens, scores, state)
    return [out[key] for key in keys]


def assert_greedy_close(ours: tuple, theirs: tuple, noise: float) -> None:
    """Two greedy decodes of one prompt (``drive``'s tokens and top-2 logprob
    entries) agree token for token, the logprobs they share within ``noise``, up
    to a near tie: both then had the same two best tokens, within 2 * ``noise``.
    A masking or padding mistake moves logprobs by whole units."""
    (our_tokens, our_scores, _), (their_tokens, their_scores, _) = ours, theirs
    assert len(our_tokens) == len(their_tokens)
    for mine, theirs_, (_, my_top), (_, their_top) in zip(
        our_tokens, their_tokens, our_scores, their_scores
    ):
        my_top, their_top = dict(my_top), dict(their_top)
        assert {mine, theirs_} <= my_top.keys() & their_top.keys()
        for token in my_top.keys() & their_top.keys():
            assert my_top[token] == pytest.approx(their_top[token], abs=noise)
        if mine != theirs_:
            assert my_top.keys() == their_top.keys()
            return


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
