"""What Status and GetMetrics report, published by the engine thread.

Handlers read the last published figures (immutable values) from their own
threads; the engine thread publishes after each message, each load and every few
decode steps.
"""

from dataclasses import dataclass

from mlx_backend.distributed.leader import Leader, Solo
from mlx_backend.engine.loader import ServedModel
from mlx_backend.engine.prompt_store import PromptCounts
from mlx_backend.output.reply_pipeline import Finished
from mlx_utils import memory_snapshot

# Memory readings are refreshed every this many decode steps.
STATS_INTERVAL = 16


@dataclass(frozen=True)
class RequestMetrics:
    """What GetMetrics reports of the most recently finished request."""

    tokens_generated: int = 0
    tokens_per_second: float = 0.0
    prompt_tokens_processed: int = 0
    slot_id: int = 0
    # Speculative decoding: tokens proposed for the request, and those kept.
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0


def make_request_metrics(
    final: Finished, prefilled: int, slot: int, proposed: int, accepted: int
) -> RequestMetrics:
    seconds = final.generation_seconds
    return RequestMetrics(
        tokens_generated=final.completion_tokens,
        tokens_per_second=final.completion_tokens / seconds if seconds > 0 else 0.0,
        prompt_tokens_processed=prefilled,
        slot_id=slot,
        draft_tokens_proposed=proposed,
        draft_tokens_accepted=accepted,
    )


@dataclass(frozen=True)
class EngineStats:
    state: str  # "uninitialized", "loading", "ready", "busy" or "error"
    active: int
    memory: dict[str, int]


class Stats:
    """The engine's figures: its state, its step count, the prompt counts of every
    load since it started, and what it last published."""

    def __init__(self):
        self.state = "uninitialized"
        self.steps = 0
        self.prompts = PromptCounts()
        self.published = EngineStats("uninitialized", 0, {})

    def count_step(self) -> bool:
        """Count a step; True when its figures are due to be published."""
        self.steps += 1
        return self.steps % STATS_INTERVAL == 0

    def publish(
        self,
        served: ServedModel | None,
        active: int,
        group: Solo | Leader,
        admission: dict[str, int],
    ) -> None:
        """Publish the figures of ``served`` with ``active`` sequences running and
        the scheduler's ``admission`` figures (the memory budget's parts)."""
        state = self.state
        if state == "ready" and active:
            state = "busy"
        if group.broken:
            state = "error"
        memory = memory_snapshot()
        decoder = None
        if served is not None:
            memory.update(served.info.compute_path.breakdown())
            memory.update(grammars_compiled=served.info.grammars.compilations)
            decoder = served.decoder
        store = served.store if served is not None else None
        if served is not None:
            memory.update(served.info.cache_kinds.breakdown())
        memory.update(
            prompt_cache_entries=len(store.cache) if store else 0,
            prompt_cache_bytes=store.cache.nbytes if store else 0,
            prompt_cache_reused_tokens=self.prompts.reused,
            prompt_tokens_prefilled=self.prompts.prefilled,
            batch_decode_steps=decoder.batch_steps if decoder else 0,
            batch_decode_tokens=decoder.batch_tokens if decoder else 0,
            draft_tokens_proposed=decoder.draft_proposed if decoder else 0,
            draft_tokens_accepted=decoder.draft_accepted if decoder else 0,
            speculative_decoding=int(decoder.speculates) if decoder else 0,
            distributed_ranks=group.size,
            step_token_budget=decoder.step_token_budget if decoder else 0,
            **admission,
        )
        self.published = EngineStats(state, active, memory)
