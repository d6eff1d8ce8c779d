"""The decoder for a loaded model: which generation path serves it."""

import logging
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from mlx_backend.caches.kinds import layer_kind
from mlx_backend.caches.paged import LayerShape
from mlx_backend.caches.recurrent import RecurrentShape
from mlx_backend.decoders.base import Decoder
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.measured import measured_once
from mlx_backend.decoders.paged import NotPaged, PagedDecoder, paged_layers
from mlx_backend.decoders.proposers import DraftProposer, NgramProposer
from mlx_backend.decoders.single import SingleDecoder
from mlx_backend.decoders.speculative import (
    SpeculativeDecoder,
    measure_verify_costs,
    replay_room,
)
from mlx_backend.decoders.step_budget import NO_STEP_BUDGET, StepBudget
from mlx_backend.errors import InvalidArgument
from mlx_utils import make_kv_cache, model_signature, unbatchable_reason
from python_utils import LoadOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PagedChoice:
    """Whether the paged pass serves a model: its layers' shapes, or why not."""

    shapes: tuple[LayerShape | RecurrentShape, ...] = ()
    why_not: str = ""


def choose_paged(model: nn.Module, options: LoadOptions) -> PagedChoice:
    """The paged pass where the options ask for it (``use_paged``) and a probe
    finds it gives the model's logits; the load log says which."""
    if not use_paged(options):
        return PagedChoice(why_not="paged is off (paged:true turns it on)")
    try:
        shapes = paged_layers(model, options)
    except NotPaged as e:
        logger.info("the paged pass is off: %s", e)
        return PagedChoice(why_not=f"the paged pass can't serve this model: {e}")
    logger.info("one forward pass per step over paged KV")
    return PagedChoice(tuple(shapes))


def make_plain_decoder(
    model: nn.Module,
    options: LoadOptions,
    pace: bool = False,
    budget: StepBudget = NO_STEP_BUDGET,
    paged: PagedChoice | None = None,
) -> Decoder:
    """The plain decoder for a loaded model: over pages where ``paged`` (by
    default ``choose_paged``) says so, else batched when its KV caches can be
    merged, with paced CPU steps when ``pace`` (``make_pacing``); prefill within
    the step token ``budget``."""
    paged = paged or choose_paged(model, options)
    if paged.shapes:
        return PagedDecoder(model, options, list(paged.shapes), budget)
    refuse_kv_dtype(options, paged.why_not)
    if options.cache_float:
        # llama.cpp's KV types are its choice of precision, not a demand.
        logger.info(
            "KV type %s (CacheTypeKey/Value) is for pages: %s, so the KV keeps "
            "the model's type",
            options.cache_float,
            paged.why_not,
        )
    trimmable = can_trim_prompt_cache(make_kv_cache(model, options))
    why = unbatchable_reason(model, options)
    if why:
        logger.info("requests run one sequence each: %s", why)
        return SingleDecoder(model, options, trimmable)
    return BatchDecoder(model, options, trimmable, pace, budget)


def refuse_kv_dtype(options: LoadOptions, why_not: str) -> None:
    """``kv_dtype`` types the paged decoder's pages: refused where ``why_not``
    says the paged decoder won't serve."""
    if options.kv_dtype != "auto":
        raise InvalidArgument(
            f"Options: kv_dtype sets the type of the paged decoder's pages, and "
            f"{why_not}; remove kv_dtype"
        )


def use_paged(options: LoadOptions) -> bool:
    """Whether the options ask for the paged pass: ``paged``, where "auto" is on
    the CPU (on a GPU it waits for a lent device's measurement)."""
    if options.paged is not None:
        return options.paged
    return mx.default_device() == mx.cpu


def make_decoder(
    model: nn.Module,
    options: LoadOptions,
    draft: nn.Module | None = None,
    pace: bool = False,
    budget: StepBudget = NO_STEP_BUDGET,
    paged: PagedChoice | None = None,
) -> Decoder:
    """The decoder for a loaded model: the plain one (batched when its KV caches
    can be merged, with paced CPU steps when ``pace``), speculating with
    ``draft`` or n-gram prompt lookup (the paged decoder for each row, any other
    for a lone sequence), unless that is off (or the KV caches can't go back and
    the sequences run one each)."""
    inner = make_plain_decoder(model, options, pace, budget, paged)
    kinds = {layer_kind(c) for c in make_kv_cache(model, options)}
    why = None
    if options.speculative == "off" or options.num_draft_tokens == 0:
        why = "turned off by the options"
    elif "other" in kinds:
        why = "the KV cache has layers it can neither trim nor hold"
    elif kinds != {"growing"} and not inner.capabilities.batching:
        # Leaving the plain decoder takes the token its step sampled: only a batch
        # has it, since these caches can't give back the last token.
        why = "the sequence's window or recurrent state can't be trimmed back"
    if why:
        logger.info("speculative decoding is off: %s", why)
        return inner
    # Pages take back any layer's rejected tokens: a window's too.
    rollback = kinds != {"growing"} and not isinstance(inner, PagedDecoder)
    if draft is not None and {layer_kind(c) for c in make_prompt_cache(draft)} != {
        "growing"
    }:
        logger.info("the draft model's KV cache can't be trimmed: n-gram proposals")
        draft = None
    max_draft = max(options.num_draft_tokens, 8)
    drafting = draft if options.speculative != "ngram" else None
    replay = replay_room(max_draft) if rollback else 0
    costs, per_proposal = measured_once(
        model,
        ("verify costs", max_draft, replay, drafting and model_signature(drafting, {})),
        partial(measure_verify_costs, model, max_draft, drafting, replay),
    )
    if draft is not None and options.speculative in ("auto", "draft"):
        proposer = "the draft model"
        make_proposer = partial(DraftProposer, draft, options.prefill_step_size)
    else:
        n_min, n_max = options.ngram_min, options.ngram_max
        proposer = f"n-gram prompt lookup (n {n_min}-{n_max})"
        make_proposer = partial(NgramProposer, n_min, n_max)
    logger.info(
        "speculative decoding: %s, up to %d tokens a step%s; one pass over 1+k "
        "tokens costs %s times one token (k = 1..%d), a proposal %.2f",
        proposer,
        options.num_draft_tokens,
        (
            ", rejected proposals rolled back to held window and state, the kept "
            "tokens run again in front of the next pass"
            if rollback
            else ""
        ),
        ", ".join(f"{c:.2f}" for c in costs[1 : max_draft + 1]),
        max_draft,
        per_proposal,
    )
    if isinstance(inner, PagedDecoder):
        inner.speculate(make_proposer, costs, per_proposal)
        return inner
    return SpeculativeDecoder(
        inner,
        model,
        make_proposer,
        costs=costs,
        per_proposal=per_proposal,
        rollback=rollback,
    )
