"""The KV bytes a burst holds (issue 68), in-process: 8 requests that share a
1,000-token system prompt, each with a question of its own, 128 tokens each
(greedy, ignoring EOS), on the paged decoder and on the batch decoder.

    venv/bin/python -m bench.shared_burst [--rounds 2]

The first request prefills the prefix and the others wait for it (prefix
sharing). The figure is the most KV bytes held at any step against one prefix
plus the 8 suffixes (each request's own prompt tokens and its reply): on the
paged side the store's pages, the prompt cache's entries included (they share
the pages); on the batch side the batch's KV and the prompt cache's copies.
"""

import argparse
import asyncio
import random

from bench.model_families import varied_text
from mlx_backend.caches.paged import PAGE_TOKENS, PagedKV
from mlx_backend.decoders.paged import paged_layers
from mlx_backend.request_parsing import GenerationRequest
from mlx_cache import common_length
from tests.engine_helpers import load_engine, on_engine_thread

REQUESTS = 8
PREFIX_TOKENS = 1000
REPLY_TOKENS = 128
SIDES = {"paged": ("paged:true",), "batch": ("paged:false",)}


def bytes_per_token(model, options) -> int:
    kv = PagedKV(paged_layers(model, options), arena_pages=1)
    return kv.page_nbytes // PAGE_TOKENS


def prompts_of(engine) -> list[tuple[int, ...]]:
    tokenizer = engine.info.tokenizer
    system = varied_text(random.Random(68), tokenizer, PREFIX_TOKENS)
    prompts = []
    for i in range(REQUESTS):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {i}: what happened {i} times?"},
        ]
        prompts.append(
            tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        )
    return prompts


def peak_bytes(engine, prompts) -> int:
    served = engine.served
    decoder, peak, step = served.decoder, [0], served.decoder.step
    paged = type(decoder).__name__ == "PagedDecoder"

    def measured():
        results = step()
        if paged:
            held = decoder.pages_nbytes()
        else:
            held = decoder.kv_nbytes() + served.store.cache.nbytes
        peak[0] = max(peak[0], held)
        return results

    on_engine_thread(engine, lambda *_: setattr(decoder, "step", measured))

    async def main():
        loop = asyncio.get_running_loop()
        streams = [
            engine.submit(
                GenerationRequest(
                    prompt=p,
                    max_tokens=REPLY_TOKENS,
                    load_id=engine.info.load_id,
                    ignore_eos=True,
                ),
                loop,
            )
            for p in prompts
        ]

        async def drain(stream):
            return [event async for event in stream]

        await asyncio.gather(*(drain(s) for s in streams))

    asyncio.run(main())
    on_engine_thread(engine, lambda *_: delattr(decoder, "step"))
    return peak[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    out = {name: [] for name in SIDES}
    for round_ in range(args.rounds):
        for name in SIDES if round_ % 2 == 0 else reversed(SIDES):
            engine = load_engine(*SIDES[name])
            try:
                prompts = prompts_of(engine)
                prefix = min(common_length(prompts[0], p) for p in prompts[1:])
                own = sum(len(p) - prefix + REPLY_TOKENS for p in prompts)
                per_token = on_engine_thread(engine, bytes_per_token)
                ideal = (prefix + own) * per_token
                out[name].append((peak_bytes(engine, prompts), ideal, prefix))
            finally:
                engine.shutdown()
    for name, runs in out.items():
        cells = ", ".join(
            f"{held / 2**20:.1f} MiB / {ideal / 2**20:.1f} MiB = {held / ideal:.2f}x"
            for held, ideal, _ in runs
        )
        print(
            f"{name}: {REQUESTS} requests sharing a {runs[0][2]}-token prefix, "
            f"peak KV held / one prefix and the suffixes: {cells}; "
            f"worst {max(h / i for h, i, _ in runs):.2f}x"
        )


if __name__ == "__main__":
    main()
