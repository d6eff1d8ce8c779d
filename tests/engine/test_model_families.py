"""Every model family through every path, in-process: one tiny random-weight model
per family mlx-lm serves (``tests/family_models.py``: full, sliding-window,
recurrent and MLA caches), each reply compared with mlx-lm's own greedy decoding
of the same folder. Per family: alone and in a batch of four; a chat's second
turn past the sliding window, which reuses the first turn's prompt; three
requests sharing a 300-token prefix; speculation on a reference continuation with wrong proposals among it; q8_0 KV
against mlx-lm's quantized attention (or refused, naming the layer); a restart
from prompt_cache_dir; logprobs, Score, Embedding and a grammar."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import load as load_mlx_lm

from mlx_backend.decoders.base import NewSequence
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.paged import PagedDecoder
from mlx_backend.decoders.speculative import SpeculativeDecoder
from mlx_backend.decoders.step_budget import SHORT_PROMPT_TOKENS, StepBudget
from mlx_backend.engine.engine import Engine
from mlx_backend.errors import InvalidArgument
from mlx_backend.models.loading import LoadPlan
from mlx_backend.models.mlx_lm_fixes import apply_fixes
from mlx_backend.request_parsing import (
    EmbeddingRequest,
    GenerationRequest,
    ScoreRequest,
)
from mlx_utils import make_kv_cache
from python_utils import parse_options
from tests.engine_helpers import log_softmax, run, stats_after, text_of
from tests.family_models import FAMILIES, WINDOW
from tests.support import (
    assert_text_as_reference,
    assert_tokens_as_reference,
    device_tolerance,
    greedy_steps,
)
from tests.tiny_models import FLAT

# The chat parser stays out of the way: gpt-oss would be read as harmony, whose
# markers the tiny models' vocabulary lacks.
PLAIN = ("tool_parser:none", "reasoning:none")
QUESTIONS = (
    "What time does the bakery open on Sundays?",
    "Name three rivers in France and the seas they reach.",
    "How do I keep sourdough starter alive while I travel for two weeks?",
    "Write a haiku about a lighthouse keeper in winter.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron, and why?",
    "Explain in two sentences what a prompt cache is for.",
)
SYSTEM = (
    "You are the assistant of a public library in Lyon. You answer questions "
    "about opening hours, loans, the reading rooms, the children's corner, the "
    "archive of old maps, the music collection and the events of each month. "
)
REPETITIVE = "one two three four five six seven eight, " * 12


class Family:
    """One family's folder, an engine serving it, and mlx-lm's reference."""

    def __init__(self, name: str, folder: Path):
        self.name, self.folder = name, folder
        self.engine = self.start()
        self.model, self.tokenizer = load_mlx_lm(str(folder))

    def start(self, *options: str) -> Engine:
        engine = Engine()
        plan = LoadPlan(
            identity=self.name,
            model=str(self.folder),
            options=parse_options([*PLAIN, *options]),
        )
        engine.load(plan).result()
        return engine

    def chat(self, messages: list[dict]) -> tuple[int, ...]:
        return tuple(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        )

    def ask(self, question: str, system: str = "") -> tuple[int, ...]:
        messages = [{"role": "system", "content": system}] if system else []
        return self.chat([*messages, {"role": "user", "content": question}])

    def request(self, prompt: tuple[int, ...], **fields) -> GenerationRequest:
        fields.setdefault("max_tokens", 12)
        return GenerationRequest(
            prompt=prompt, load_id=self.engine.info.load_id, **fields
        )

    def steps(self, prompt, max_tokens: int = 12, cache=None) -> list:
        """mlx-lm's greedy tokens for ``prompt`` with their margins."""
        ends = self.tokenizer.eos_token_ids
        return greedy_steps(self.model, prompt, max_tokens, ends, cache)

    def reference(self, prompt, max_tokens: int = 12, cache=None) -> list[int]:
        """mlx-lm's greedy tokens for ``prompt``, up to the end token."""
        ends = self.tokenizer.eos_token_ids
        return [t for t, _ in self.steps(prompt, max_tokens, cache) if t not in ends]

    def assert_text(self, text: str, prompt, max_tokens: int = 12, cache=None):
        """``text`` is mlx-lm's greedy reply to ``prompt`` (up to a near tie)."""
        steps = self.steps(prompt, max_tokens, cache)
        ends = self.tokenizer.eos_token_ids
        assert_text_as_reference(text, steps, self.tokenizer.decode, ends)

    def assert_tokens(self, tokens: list[int], prompt, max_tokens: int = 12):
        """``tokens`` (to the end token) are mlx-lm's (up to a near tie)."""
        steps = self.steps(prompt, max_tokens)
        assert_tokens_as_reference(tokens, steps, self.tokenizer.eos_token_ids)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, family_folder):
    apply_fixes()
    folder = family_folder(request.param)
    family = Family(request.param, folder)
    yield family
    family.engine.shutdown()


def figures(family: Family) -> dict[str, int]:
    return dict(stats_after(family.engine))


def test_alone_and_in_a_batch_as_mlx_lm(family):
    alone = [family.ask(q) for q in QUESTIONS[:2]]
    for prompt in alone:
        events = run(family.engine, family.request(prompt))[0]
        family.assert_text(text_of(events), prompt)
    batch = [family.ask(q) for q in QUESTIONS[2:]]
    replies = run(family.engine, *(family.request(p) for p in batch))
    for prompt, events in zip(batch, replies):
        family.assert_text(text_of(events), prompt)
    status = figures(family)
    assert status["batch_decode_tokens"] > status["batch_decode_steps"]
    # Every family runs in the paged pass on the CPU.
    paged = isinstance(family.engine.served.decoder, PagedDecoder)
    assert paged == (mx.default_device() == mx.cpu)


def test_a_second_turn_reuses_the_first(family):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    first = family.chat(messages)
    assert len(first) > 4 * WINDOW
    reply = text_of(run(family.engine, family.request(first))[0])
    before = figures(family)
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    second = family.chat(messages)
    events = run(family.engine, family.request(second))[0]
    reused = (
        figures(family)["prompt_cache_reused_tokens"]
        - before["prompt_cache_reused_tokens"]
    )
    family.assert_text(text_of(events), second)
    assert reused > 0.8 * len(first)


def test_a_shared_prefix_is_prefilled_once(family):
    system = SYSTEM * 7
    prompts = [family.ask(q, system) for q in QUESTIONS[3:]]
    shared = min(
        next(i for i, (a, b) in enumerate(zip(p, prompts[0])) if a != b)
        for p in prompts[1:]
    )
    assert shared >= 300
    before = figures(family)
    replies = run(family.engine, *(family.request(p) for p in prompts))
    reused = (
        figures(family)["prompt_cache_reused_tokens"]
        - before["prompt_cache_reused_tokens"]
    )
    for prompt, events in zip(prompts, replies):
        family.assert_text(text_of(events), prompt)
    # Two requests started from the third's prefix.
    assert reused >= 2 * (shared - 64)


def test_a_short_prompt_beside_a_long_one_as_mlx_lm(family):
    """While a sequence decodes, a short prompt prefills in passes of its own and
    joins the decode batch directly, and a long one prefills in the prompt batch:
    each as mlx-lm alone, and the short prompt's mid-prompt snapshot continues as
    mlx-lm from there (a copy the later chunks left alone)."""
    stream, long, short = (
        family.ask(QUESTIONS[0]),
        family.ask(QUESTIONS[1], SYSTEM),
        family.ask(QUESTIONS[5]),
    )
    assert len(short) <= SHORT_PROMPT_TOKENS < len(long)
    middle = len(short) // 2

    def serve(model, options):
        decoder = BatchDecoder(
            model, options, True, budget=StepBudget("test", tokens=6)
        )

        def add(prompt, max_tokens, snapshots=()):
            cache = make_kv_cache(model, options)
            return decoder.add(
                NewSequence(
                    prompt,
                    prompt,
                    cache,
                    greedy_sampler,
                    [],
                    max_tokens,
                    snapshots=snapshots,
                )
            )

        keys = [add(stream, 24)]
        tokens, kept, batched = {keys[0]: []}, {}, set()
        while not tokens[keys[0]]:
            for result in decoder.step():
                tokens[result.key] += result.tokens
        keys += [add(long, 12), add(short, 12, (middle, len(short) - 1))]
        tokens.update({key: [] for key in keys[1:]})
        while decoder._rows:
            batched.update(decoder._batch._prompt_batch.uids)
            for result in decoder.step():
                tokens[result.key] += result.tokens
                kept.update({len(s.tokens): s.cache for s in result.snapshots})
        decoder.close()
        rest = mx.array(short[middle:])
        after = list(
            generate_step(rest, model, max_tokens=12, prompt_cache=kept[middle])
        )
        return [tokens[key] for key in keys], batched, keys, sorted(kept), after

    replies, batched, keys, kept, after = family.engine.call(
        lambda: serve(family.engine.served.model, family.engine.info.options)
    ).result()
    ends = family.tokenizer.eos_token_ids

    def until_end(tokens: list[int]) -> list[int]:
        return tokens[: next((i for i, t in enumerate(tokens) if t in ends), None)]

    for prompt, tokens, n in zip((stream, long, short), replies, (24, 12, 12)):
        family.assert_tokens(until_end(tokens), prompt, n)
    assert keys[1] in batched and keys[2] not in batched
    assert kept == [middle, len(short) - 1]
    family.assert_tokens(until_end([t for t, _ in after]), short)


class Oracle:
    """Proposes the reference continuation with every fourth proposal wrong, so
    verifications accept some and roll back past the rest; cheap, so plain
    decoding earns it the estimate that makes speculating pay."""

    cheap = True

    def __init__(self, prompt: tuple[int, ...], reference: list[int]):
        self.known = [*prompt, *reference]

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        ahead = self.known[len(tokens) : len(tokens) + limit]
        return [t + 1 if (len(tokens) + i) % 4 == 0 else t for i, t in enumerate(ahead)]

    def rewind(self, accepted: int, proposed: int) -> None:
        pass


def test_speculation_rolls_back_rejected_proposals(family):
    """Speculation, with proposals kept and rejected, gives mlx-lm's tokens: the
    windows and recurrent state roll back where their caches can't be trimmed."""
    status = figures(family)
    assert status["speculative_decoding"] == 1
    prompt = family.ask(REPETITIVE)
    reference = family.reference(prompt, 40)

    rollback = status.get("prompt_reuse_by.snapshot", 0) == 1

    def speculate(model, options):
        decoder = SpeculativeDecoder(
            BatchDecoder(model, options, not rollback),
            model,
            lambda: Oracle(prompt, reference),
            costs=FLAT,
            rollback=rollback,
        )
        cache = make_kv_cache(model, options)
        key = decoder.add(
            NewSequence(prompt, prompt, cache, greedy_sampler, [], 40, draft_tokens=6)
        )
        tokens, done = [], False
        while not done:
            for result in decoder.step():
                assert result.key == key and result.error is None
                tokens += result.tokens
                done = result.done
        decoder.close()
        return tokens, decoder.draft_proposed, decoder.draft_accepted

    tokens, proposed, accepted = family.engine.call(
        lambda: speculate(family.engine.served.model, family.engine.info.options)
    ).result()
    end = next(
        (i for i, t in enumerate(tokens) if t in family.tokenizer.eos_token_ids),
        len(tokens),
    )
    family.assert_tokens(tokens[:end], prompt, 40)
    assert 0 < accepted < proposed


def test_the_load_names_the_cache_kinds(family):
    status = figures(family)
    kinds = {
        name.split(".", 1)[1]: n
        for name, n in status.items()
        if name.startswith("kv_cache_layers.")
    }
    cache = make_prompt_cache(family.model)
    assert sum(kinds.values()) == len(cache)
    trims = all(type(c) is KVCache for c in cache)
    assert status["prompt_reuse_by.trim" if trims else "prompt_reuse_by.snapshot"]


def test_q8_kv_as_mlx_lm_or_refused(family):
    options = ("kv_bits:8", "kv_group_size:32")
    if family.name == "deepseek_v3":
        # mlx-lm's multi-head latent attention reads its cached latents whole.
        with pytest.raises(InvalidArgument, match="DeepseekV3Attention"):
            family.start(*options)
        return
    engine = family.start(*options)
    try:
        prompt = family.ask(QUESTIONS[2])
        cache = [
            QuantizedKVCache(group_size=32, bits=8) if type(c) is KVCache else c
            for c in make_prompt_cache(family.model)
        ]
        request = GenerationRequest(
            prompt=prompt, max_tokens=12, load_id=engine.info.load_id
        )
        family.assert_text(text_of(run(engine, request)[0]), prompt, cache=cache)
    finally:
        engine.shutdown()


def test_a_restart_resumes_from_prompt_cache_dir(family, tmp_path):
    option = f"prompt_cache_dir:{tmp_path}"
    first = family.ask(QUESTIONS[4], SYSTEM)
    engine = family.start(option)
    try:
        reply = text_of(
            run(engine, GenerationRequest(first, 8, load_id=engine.info.load_id))[0]
        )
    finally:
        engine.shutdown()
    second = family.chat(
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTIONS[4]},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": QUESTIONS[5]},
        ]
    )
    engine = family.start(option)
    try:
        request = GenerationRequest(second, 12, load_id=engine.info.load_id)
        events = run(engine, request)[0]
        reused = stats_after(engine)["prompt_cache_reused_tokens"]
    finally:
        engine.shutdown()
    family.assert_text(text_of(events), second)
    assert reused > 0.8 * len(first)


def test_logprobs_score_embedding_and_grammar(family):
    prompt = family.ask(QUESTIONS[1])
    events = run(family.engine, family.request(prompt, max_tokens=6, logprobs=2))[0]
    ours = [entry.logprob for e in events for entry in e.logprobs]
    logits = family.model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    assert ours[0] == pytest.approx(
        float(log_softmax(np.array(logits)).max()), abs=device_tolerance(1e-3, 10)
    )
    family.assert_text(text_of(events), prompt, 6)

    candidates = (tuple(family.tokenizer.encode(" yes")), (11, 12, 13))
    scores = family.engine.compute(
        ScoreRequest(prompt, candidates, family.engine.info.load_id)
    ).result()
    for candidate, score in zip(candidates, scores):
        full = mx.array([*prompt, *candidate])[None]
        logits = np.array(family.model(full)[0].astype(mx.float32))
        rows = log_softmax(logits[len(prompt) - 1 : -1])
        expected = [rows[i, t] for i, t in enumerate(candidate)]
        assert score == pytest.approx(expected, abs=device_tolerance(1e-3, 10))

    request = EmbeddingRequest(prompt, family.engine.info.load_id)
    vector = family.engine.compute(request).result()
    assert len(vector) > 0 and np.isfinite(vector).all()
    assert family.engine.compute(request).result() == pytest.approx(vector)

    grammar = family.engine.info.grammars.compile(json.dumps({"type": "boolean"}))
    events = run(family.engine, family.request(prompt, max_tokens=8, grammar=grammar))
    assert text_of(events[0]) in ("true", "false")
