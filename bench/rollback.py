"""Part 10's speculation with rollback, in-process: on weights that don't copy,
proposals from the model's own greedy continuation with a wrong token every
``miss`` tokens stand in for what prompt lookup would offer a model that copies;
each verification rolls the recurrent state back as n-gram proposals do."""

import statistics
import time
from functools import partial
from pathlib import Path

from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import load as mlx_lm_load

from mlx_backend.cpu.compute_path import CPU_PREFILL_STEP_SIZE
from mlx_backend.decoders.base import NewSequence
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.speculative import (
    SpeculativeDecoder,
    measure_verify_costs,
    replay_room,
)
from mlx_utils import make_kv_cache
from python_utils import parse_options

# The oracle's proposals are wrong every this many tokens.
ORACLE_MISSES = (10, 50)
DRAFT_TOKENS = 8


class Oracle:
    """Proposes the model's own greedy continuation with every ``miss``-th proposal
    wrong: the acceptance a model that copies its prompt would see, on weights
    that don't copy."""

    cheap = True

    def __init__(self, known: list[int], miss: int):
        self.known, self.miss = known, miss

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        ahead = self.known[len(tokens) : len(tokens) + limit]
        n = len(tokens)
        return [t + 1 if (n + i) % self.miss == 0 else t for i, t in enumerate(ahead)]

    def rewind(self, accepted: int, proposed: int) -> None:
        pass


def rollback_speculation(
    folder: Path, prompt: tuple[int, ...], max_tokens: int, eos: int, rounds: int
) -> dict:
    """Decode tok/s of ``max_tokens`` greedy tokens (``eos`` banned) plainly and
    speculating with ``Oracle`` proposals for each of ``ORACLE_MISSES``; the
    verify costs measured as the server measures them at load."""
    model, _ = mlx_lm_load(str(folder))
    # The CPU path's prefill chunk, as the server's load sets it.
    options = parse_options([f"prefill_step_size:{CPU_PREFILL_STEP_SIZE}"])
    lone = partial(drive_lone, model=model, options=options, prompt=prompt)
    lone = partial(lone, max_tokens=max_tokens, eos=eos)
    plain = BatchDecoder(model, options, trimmable=False)
    known = list(prompt) + lone(plain, draft_tokens=0)[0]
    costs, _ = measure_verify_costs(
        model, DRAFT_TOKENS, replay=replay_room(DRAFT_TOKENS)
    )
    sides = ("plain", *(f"miss {n}" for n in ORACLE_MISSES))
    rates: dict = {name: [] for name in sides}
    counts = {name: [0, 0] for name in sides}
    for r in range(2 * rounds):
        for name in sides[:: 1 if r % 2 else -1]:
            decoder = BatchDecoder(model, options, trimmable=False)
            if name != "plain":
                miss = int(name.split()[1])
                decoder = SpeculativeDecoder(
                    decoder,
                    model,
                    partial(Oracle, known, miss),
                    costs=costs,
                    rollback=True,
                )
            tokens, seconds = lone(decoder, draft_tokens=DRAFT_TOKENS)
            if tokens != known[len(prompt) :]:
                raise RuntimeError("speculation changed the greedy tokens")
            rates[name].append((len(tokens) - 1) / seconds)
            counts[name][0] += decoder.draft_proposed
            counts[name][1] += decoder.draft_accepted
    return {
        "tok_s": {name: statistics.median(rates[name]) for name in sides},
        "proposed_accepted": counts,
        "costs": costs,
    }


def drive_lone(
    decoder, *, model, options, prompt, max_tokens: int, eos: int, draft_tokens: int
):
    """One greedy sequence to ``max_tokens`` tokens (``eos`` banned); its tokens
    and the seconds from its first token to its last."""
    decoder.add(
        NewSequence(
            prompt,
            prompt,
            make_kv_cache(model, options),
            greedy_sampler,
            [lambda _, logits: logits.at[:, eos].add(-1e9)],
            max_tokens,
            draft_tokens=draft_tokens,
        )
    )
    tokens, done, start = [], False, None
    while not done:
        for result in decoder.step():
            if result.tokens and start is None:
                start = time.perf_counter()
            tokens += result.tokens
            done = result.done
    seconds = time.perf_counter() - start
    decoder.close()
    return tokens, seconds


def rollback_lines(rollback: dict) -> list[str]:
    costs = ", ".join(f"{c:.2f}" for c in rollback["costs"][1 : DRAFT_TOKENS + 1])
    plain = rollback["tok_s"]["plain"]
    misses = " or every ".join(f"{n}th" for n in ORACLE_MISSES)
    lines = [
        "In-process, the same prompt: proposals from the model's own greedy "
        f"continuation with every {misses} token wrong (what a model that "
        "copies would be offered), verified, and rolled back over the recurrent "
        f"state as n-gram proposals are; a pass over 1+k tokens costs {costs} times "
        f"one (k = 1..{DRAFT_TOKENS}). Plain decode: {plain:.1f} tok/s.",
        "",
        "| speculation with rollback | tok/s | on / off | accepted / proposed | goal |",
        "|---|---|---|---|---|",
    ]
    for name, rate in rollback["tok_s"].items():
        if name == "plain":
            continue
        proposed, accepted = rollback["proposed_accepted"][name]
        lines.append(
            f"| {name} | {rate:.1f} | {rate / plain:.2f}x | {accepted}/{proposed} "
            f"| ≥ 1.5x |"
        )
    return lines
