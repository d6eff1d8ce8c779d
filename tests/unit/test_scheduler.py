"""The scheduler without an engine thread or a model: admission and its refusals,
step results through the reply pipeline, cancellation, slow clients and slots,
against a fake decoder and prompt store and the default model's real tokenizer."""

from types import SimpleNamespace

import pytest

from mlx_backend.decoders.base import Capabilities, KVState, StepResult
from mlx_backend.engine.loop import Submit
from mlx_backend.engine.memory_budget import KVSizer, LayerBytes, MemoryBudget
from mlx_backend.engine.scheduler import Scheduler
from mlx_backend.errors import (
    Aborted,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
)
from mlx_backend.formats.base import ChatFormat
from mlx_backend.output.chat_output import merge_deltas
from mlx_backend.output.detokenizer import make_token_bytes
from mlx_backend.output.reply_pipeline import Finished
from mlx_backend.request_parsing import GenerationRequest
from python_utils import LoadOptions

PROMPT = (1, 2, 3, 4, 5, 6)


class FakeStream:
    def __init__(self, backlog=0):
        self.events, self.cancelled, self.backlog = [], False, backlog

    def put(self, event):
        self.events.append(event)


class FakeDecoder:
    capabilities = Capabilities(batching=True, trimmable_cache=True)

    def __init__(self):
        self.added, self.removed = [], []

    def add(self, sequence):
        self.added.append(sequence)
        return len(self.added) - 1

    def remove(self, key, keep_state=True):
        self.removed.append(key)
        return KVState([f"kv{key}"], list(self.added[key].prompt))

    def kv_nbytes(self):
        return 0

    def free_pool_nbytes(self):
        return 0


class FakeStore:
    """Serves all but the last two prompt tokens, and keeps what it is given."""

    cache = SimpleNamespace(nbytes=0)

    def __init__(self):
        self.kept = []

    def fetch(self, prompt, pages=False):
        return ["cached"], tuple(prompt[-2:])

    def keep(self, cache, tokens, holders=1, later=False):
        self.kept.append((cache, tuple(tokens)))

    def shrink(self, room):
        self.room = room


LOST = "the distributed group of 2 ranks is lost (test)"


@pytest.fixture
def served(tokenizer):
    info = SimpleNamespace(
        tokenizer=tokenizer,
        chat_format=ChatFormat(),
        token_bytes=make_token_bytes(tokenizer),
        load_id=7,
        vocab_size=len(tokenizer.vocab),
        options=LoadOptions(max_stream_backlog=4, prefix_sharing=False),
    )
    return SimpleNamespace(
        info=info, decoder=FakeDecoder(), store=FakeStore(), budget=None
    )


def waiting(scheduler: Scheduler, load_id: int = 7, backlog: int = 0) -> FakeStream:
    stream = FakeStream(backlog)
    request = GenerationRequest(prompt=PROMPT, max_tokens=8, load_id=load_id)
    scheduler.waiting.append(Submit(request, stream))
    return stream


def text_of(events) -> str:
    return merge_deltas(e.delta for e in events).content


@pytest.mark.parametrize(
    "load_id, unavailable, error, message",
    [
        (7, None, FailedPrecondition, "no model is loaded: call LoadModel first"),
        (6, None, Aborted, "the model was replaced while the request was queued"),
        (7, LOST, Unavailable, LOST),
    ],
    ids=["no model", "replaced", "group lost"],
)
def test_refused_admissions(served, load_id, unavailable, error, message):
    scheduler = Scheduler()
    stream = waiting(scheduler, load_id)
    model = None if error is FailedPrecondition else served
    assert scheduler.schedule(model, unavailable)
    (event,) = stream.events
    assert type(event) is error and str(event) == message
    assert not scheduler and served.decoder.added == []


def test_a_request_runs_from_the_prompt_store_to_its_stream(served, tokenizer):
    scheduler = Scheduler()
    stream = waiting(scheduler)
    assert scheduler.schedule(served, None)
    (sequence,) = served.decoder.added
    assert sequence.prompt == PROMPT and sequence.rest == PROMPT[-2:]
    assert sequence.kv_cache == ["cached"]
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    scheduler.update(served, [StepResult(0, tuple(paris), (None,) * len(paris))])
    scheduler.update(served, [StepResult(0, (eos,), (None,))])
    *outputs, final = stream.events
    assert isinstance(final, Finished) and final.finish_reason == "stop"
    assert text_of(stream.events) == " Paris"
    # Retired: its KV state kept, its figures for GetMetrics.
    assert not scheduler and served.decoder.removed == [0]
    assert served.store.kept == [(["kv0"], PROMPT)]
    metrics = scheduler.last_metrics
    assert metrics.tokens_generated == len(paris)  # EOS is not counted
    assert metrics.prompt_tokens_processed == 2 and metrics.slot_id == 0


def test_cancelled_and_unread_streams_retire_at_the_next_schedule(served):
    scheduler = Scheduler()
    cancelled, unread, kept = waiting(scheduler), waiting(scheduler), waiting(scheduler)
    scheduler.schedule(served, None)
    assert [s.slot for s in scheduler.running.values()] == [0, 1, 2]
    cancelled.cancelled, unread.backlog = True, 5
    scheduler.schedule(served, None)
    assert served.decoder.removed == [0, 1] and list(scheduler.running) == [2]
    assert cancelled.events == []
    (error,) = unread.events
    assert type(error) is ResourceExhausted
    assert "max_stream_backlog is 4" in str(error)
    # The lowest free slot goes to the next request.
    waiting(scheduler)
    scheduler.schedule(served, None)
    assert [s.slot for s in scheduler.running.values()] == [2, 0]
    assert kept.events == []


def test_abort_ends_every_request(served):
    scheduler = Scheduler()
    running = waiting(scheduler)
    scheduler.schedule(served, None)
    queued = waiting(scheduler)
    scheduler.abort("the model was unloaded")
    for stream in (running, queued):
        (event,) = stream.events
        assert type(event) is Aborted and str(event) == "the model was unloaded"
    assert not scheduler


def test_a_fine_tuning_job_holds_room_that_requests_cannot_use(served):
    # 10 bytes of KV per token: the request's 14 tokens need 140 of the 300 bytes
    # of room, which a job holding 200 leaves 100 of. With nothing running, only
    # the job's end would make room: refused rather than waiting on it.
    sizer = KVSizer((LayerBytes(per_token=10),))
    served.budget = MemoryBudget(1_300, 900, 100, sizer, rectangular=True)
    scheduler = Scheduler()
    held = [200]
    scheduler.lent = lambda: held[0]
    stream = waiting(scheduler)
    assert scheduler.schedule(served, None)
    (refusal,) = stream.events
    assert isinstance(refusal, ResourceExhausted)
    assert str(refusal) == (
        "Tokens: the prompt and reply (14 tokens) need 140 bytes of KV cache, and a "
        "fine-tuning job holds 200 bytes of the memory budget, leaving 100; send "
        "fewer tokens or retry when the job ends"
    )
    assert served.decoder.added == [] and not scheduler
    held[0] = 100
    waiting(scheduler)
    scheduler.schedule(served, None)
    assert len(served.decoder.added) == 1 and served.store.room == 200 - 140
    assert scheduler.breakdown(served)["budget_fine_tune_bytes"] == 100
