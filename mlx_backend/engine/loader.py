"""Loading a model to serve: one ``LoadPlan`` in, one ``ServedModel`` out.

A load has two halves. ``resolve`` reads and checks the new model beside the
running one (the weights of an MLX folder stay lazy), so that a failure keeps the
old model serving. ``prepare`` loads the weights and builds what serving needs:
the compute path, CPU pacing, the decoder, and the prompt store with its files.
The engine's ``Loader`` runs them for rank 0 (or a process serving alone) and
numbers the loads; a worker of a group runs the same two halves for each ``Load``
op rank 0 sends it, with the same plan.
"""

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_backend.caches.kinds import REUSE_BY_TRIM, CacheKinds, make_cache_kinds
from mlx_backend.cpu.blas import apply_blas_threads, blas_threads
from mlx_backend.cpu.kernels import kernel_settings, match_blas_threads
from mlx_backend.cpu.pacing import Pacing, make_pacing
from mlx_backend.decoders.base import Decoder
from mlx_backend.decoders.factory import (
    PagedChoice,
    choose_paged,
    make_decoder,
    make_plain_decoder,
)
from mlx_backend.decoders.measured import measured_once
from mlx_backend.decoders.step_budget import (
    StepBudget,
    StepCosts,
    choose_step_budget,
    measure_step_costs,
)
from mlx_backend.distributed.leader import LeaderDecoder
from mlx_backend.distributed.lockstep import Load, Lockstep
from mlx_backend.distributed.sharding import Sharding, choose_mode
from mlx_backend.engine.memory_budget import (
    MemoryBudget,
    check_budget_option,
    make_memory_budget,
)
from mlx_backend.engine.prompt_store import (
    PromptCounts,
    PromptStore,
    make_prompt_cache,
    make_prompt_files,
    prompt_cache_bytes,
)
from mlx_backend.errors import InvalidArgument
from mlx_backend.models.loading import (
    LoadedModel,
    LoadPlan,
    ModelInfo,
    load_draft,
    load_model,
    output_head,
    prepare_model,
)
from mlx_backend.models.lora import check_adapters
from mlx_utils import check_kv_cache, make_kv_cache
from python_utils import LoadOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """Everything one loaded model is served with, swapped in one assignment."""

    model: nn.Module
    info: ModelInfo
    decoder: Decoder
    store: PromptStore
    # What admission follows; None over a distributed group, which measures nothing.
    budget: MemoryBudget | None = None
    # The output layer alone, for Rerank's answers (None: through the whole model).
    head: Callable[[mx.array], mx.array] | None = None


@dataclass(frozen=True)
class Resolved:
    """A model read and checked, its weights still lazy where they can be."""

    plan: LoadPlan
    loaded: LoadedModel
    draft: nn.Module | None = None
    # This rank's share of the model over a group, and the model's layer count.
    sharding: Sharding | None = None
    total_layers: int = 0
    # The whole model's cache kinds: a pipeline rank's own layers may all trim
    # while another's need snapshots, and every rank must reuse alike.
    kinds: CacheKinds | None = None


def check_plan(plan: LoadPlan) -> None:
    """What a plan can't ask for, whatever it loads."""
    if plan.options.speculative == "draft" and not plan.draft:
        raise InvalidArgument("Options: speculative:draft needs a DraftModel")


def resolve(
    plan: LoadPlan, lockstep: Lockstep | None = None, mode: str | None = None
) -> Resolved:
    """Read and check ``plan``'s model (and its draft model); over a group, split
    it by ``mode``, which rank 0 chooses (None) and sends the workers."""
    options = plan.options
    if lockstep is not None:
        check_group_plan(plan)
    loaded = load_model(
        plan.model,
        model_file=plan.model_file,
        model_path=plan.model_path,
        trust_remote_code=options.trust_remote_code,
    )
    check_adapters(loaded.model, plan.adapters)
    check_kv_cache(loaded.model, options)
    check_budget_option(loaded.model, options)
    sharding = None
    if lockstep is not None:
        mode = mode or choose_mode(
            loaded.model, lockstep.size, options.distributed_mode
        )
        sharding = Sharding(lockstep.group, mode)
    draft = None
    if plan.draft:
        draft = load_draft(plan.draft, plan.model_path, loaded, options)
    kinds = make_cache_kinds(make_kv_cache(loaded.model, options))
    return Resolved(plan, loaded, draft, sharding, len(loaded.model.layers), kinds)


def check_group_plan(plan: LoadPlan) -> None:
    """What a group does not serve."""
    if plan.draft:
        raise InvalidArgument(
            "DraftModel: speculative decoding does not run distributed"
        )
    if plan.adapters:
        raise InvalidArgument("LoraAdapters: LoRA adapters are not served distributed")
    if plan.options.prompt_cache_dir:
        raise InvalidArgument(
            "Options: prompt_cache_dir is not used over a distributed group"
        )


def prepare(
    resolved: Resolved,
    load_id: int,
    max_cache_bytes: int,
    counts: PromptCounts,
    lockstep: Lockstep | None = None,
    notes: tuple[str, ...] = (),
) -> ServedModel:
    """Load ``resolved``'s weights and build what serving them needs.

    Args:
        resolved: What ``resolve`` returned.
        load_id: The number of this load, which requests and cache entries carry.
        max_cache_bytes: The prompt cache's byte budget (rank 0's, on every rank).
        counts: Where the prompt store counts what its fetches served.
        lockstep: The group's channel, when serving over one.
        notes: More of the compute path's description (the BLAS threads).
    """
    plan = resolved.plan
    loaded, info = prepare_model(
        resolved.loaded,
        plan.identity,
        plan.options,
        plan.context_size,
        load_id,
        resolved.sharding,
        plan.adapters,
    )
    model, options = loaded.model, info.options
    if lockstep is None:
        paged = choose_paged(model, options)
    else:
        # The decoder refuses kv_dtype with this reason.
        paged = PagedChoice(why_not="the paged pass does not run over a group yet")
        if options.paged:
            logger.info("%s", paged.why_not)
    if paged.shapes and mx.default_device() == mx.cpu:
        # Its steps already overlap the host: cpu_pacing is the batch decoder's.
        pacing = Pacing(False, "the paged pass queues a step before reading the last")
    else:
        pacing = make_pacing(model, options, lockstep is None, os.environ)
    path = info.compute_path.extended(pacing.describe(), paced=pacing.paced)
    for note in notes:
        path = path.extended(note)
    path = replace(path, blas_threads=blas_threads() or 0)
    if path.kernel_isa:
        path = replace(path, kernel_threads=kernel_settings().threads)
    info = replace(info, compute_path=path)
    costs = None
    # A set budget needs no measurement; a group's ranks would have to run the
    # measurement's collectives together.
    if options.step_token_budget is None and lockstep is None:
        costs = measured_once(
            model,
            ("step costs", options.kv_bits, options.max_kv_size),
            partial(measure_step_costs, model, options),
        )
    step_budget = choose_step_budget(options.step_token_budget, costs)
    logger.info("%s", step_budget.describe())
    info = replace(
        info, compute_path=info.compute_path.extended(step_budget.describe())
    )
    decoder = _make_decoder(
        model, options, resolved.draft, pacing.paced, lockstep, step_budget, paged
    )
    # PromptCachePath files may lie under ModelPath and prompt_cache_dir; a group
    # uses none.
    roots = (plan.model_path, options.prompt_cache_dir)
    info = replace(info, prompt_file_roots=tuple(Path(r).resolve() for r in roots if r))
    files = None
    if lockstep is None:
        files = make_prompt_files(
            model,
            loaded.config,
            info.source,
            info.tokenizer,
            options,
            plan.adapters,
        )
    kinds = resolved.kinds or make_cache_kinds(make_kv_cache(model, options))
    logger.info("%s", kinds.describe())
    info = replace(info, cache_kinds=kinds)
    store = PromptStore(
        make_prompt_cache(
            options,
            max_cache_bytes,
            lockstep,
            resolved.total_layers,
            kinds.reuse == REUSE_BY_TRIM,
        ),
        load_id,
        partial(make_kv_cache, model, options),
        counts,
        files,
        kinds,
    )
    budget = None
    if costs is not None:
        budget = make_memory_budget(
            model,
            options,
            _prefill_peak(costs, options),
            decoder.capabilities.batching,
            paged.shapes,
        )
    store.load_folder(options.max_cache_entries)
    # A group's ranks would have to run the head's check together.
    head = None
    if info.reranker is not None and lockstep is None:
        head = output_head(model)
        logger.info(
            "Rerank reads its answers through %s",
            "the output layer alone" if head else "the whole model",
        )
    return ServedModel(model, info, decoder, store, budget, head)


def _prefill_peak(costs: StepCosts, options: LoadOptions) -> int:
    """The most a prefill step takes beyond its KV: every row of a full prefill
    batch at a whole chunk."""
    rows = min(options.prefill_batch_size, options.max_batch_size)
    return costs.peak_bytes_per_token * rows * options.prefill_step_size


def _make_decoder(
    model: nn.Module,
    options: LoadOptions,
    draft: nn.Module | None,
    paced: bool,
    lockstep: Lockstep | None,
    budget: StepBudget,
    paged: PagedChoice,
) -> Decoder:
    if lockstep is None:
        return make_decoder(model, options, draft, paced, budget, paged)
    decoder = make_plain_decoder(model, options, paced, budget, paged)
    if not decoder.capabilities.batching:
        raise InvalidArgument("distributed serving needs a model whose KV caches batch")
    return LeaderDecoder(decoder, lockstep) if lockstep.rank == 0 else decoder


class Loader:
    """Rank 0's loads (or a lone process's): the load counter, the BLAS threads,
    and over a group the ``Load`` op and every rank's agreement."""

    def __init__(self, counts: PromptCounts):
        # The id of the latest load: loads count from 1.
        self.load_id = 0
        self._counts = counts

    def load(self, resolved: Resolved, lockstep: Lockstep | None) -> ServedModel:
        """Prepare ``resolved`` as the next load, the previous model unloaded."""
        self.load_id += 1
        options = resolved.plan.options
        max_bytes = prompt_cache_bytes(options)
        threads = apply_blas_threads(options.threads, lockstep is not None)
        match_blas_threads(options.threads)
        if lockstep is not None:
            lockstep.stall_seconds = options.distributed_step_timeout
            mode = resolved.sharding.mode
            lockstep.record(Load(resolved.plan, self.load_id, mode, max_bytes))
            lockstep.flush()
        served, error = None, None
        try:
            served = prepare(
                resolved,
                self.load_id,
                max_bytes,
                self._counts,
                lockstep,
                notes=(threads,) if threads else (),
            )
        except Exception as e:
            if lockstep is None:
                raise
            error = e
        if lockstep is not None:
            # Every rank's outcome, which all ranks must share.
            lockstep.agree(error)
        return served
