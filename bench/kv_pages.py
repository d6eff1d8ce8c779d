"""The step time of the KV's types, in-process (issue 68): two streams decoding
1,800 tokens deep on the embedded model, on the paged decoder with float32,
float16 and q8_0 pages (kv_bits 8, groups of 32) and on the batch decoder with
mlx-lm's quantized caches and with float32 ones, in alternating rounds.

    venv/bin/python -m bench.kv_pages [--rounds 3]

A step's time is the wall time of ``Decoder.step`` over 60 steps once both
streams decode (steps overlap the host, so it is the device's pace).
"""

import random
import statistics
from dataclasses import replace

from bench.in_process import make_decoder, run_rounds, step_seconds
from tests.engine_helpers import new_sequence

DEPTH = 1800
Q8 = {"kv_bits": 8, "kv_group_size": 32}
SIDES = {
    "paged, float32 pages": (True, {}),
    "paged, float16 pages": (True, {"kv_dtype": "float16"}),
    "paged, q8_0 pages": (True, Q8),
    "batch, q8_0 caches": (False, Q8),
    "batch, float32 caches": (False, {}),
}


def measure(model, options, rounds: int) -> dict:
    rng = random.Random(3)
    prompts = [tuple(rng.randrange(100, 40000) for _ in range(DEPTH)) for _ in range(2)]
    out = {name: [] for name in SIDES}
    for round_ in range(rounds):
        names = list(SIDES) if round_ % 2 == 0 else list(reversed(SIDES))
        for name in names:
            paged, fields = SIDES[name]
            o = replace(options, **fields)
            decoder = make_decoder(paged, model, o)
            out[name].append(step_seconds(decoder, model, o, prompts))
            decoder.close()
    return out


def main() -> None:
    out = run_rounds(__doc__, measure)
    for name, runs in out.items():
        cells = " / ".join(f"{s * 1e3:.1f}" for s in runs)
        print(
            f"{name}: ms a step per round {cells}; "
            f"median {statistics.median(runs) * 1e3:.1f}"
        )


if __name__ == "__main__":
    main()
