"""Part 10 of ``make bench``: model families whose KV state can't be trimmed.

A hybrid model of the default model's size: a random-weight ``qwen3_5`` with
SmolLM2-135M's width and depth (576 wide, 30 layers, 9 query and 3 KV heads of 64,
vocabulary 49152), three layers in four gated-delta linear attention (recurrent
state, ``ArraysCache``) and every fourth full attention, float32, with the default
model's tokenizer. The backend with prompt snapshots on (the default), with them
off, and ``mlx_lm.server`` load the same folder. Off is ``prompt_snapshots:false``
with ``prefix_sharing:false``: with prefix sharing on, prefill keeps the state at a
long prompt's end for requests that share it, which serves the chat's next turn
as a snapshot would; what is left is the state a request ends with (its prompt
and reply), which serves the next turn only where the reply's text encodes back to
the same tokens.

- Chat: a 6-turn chat growing to ~3000 tokens, as an agent's grows: a first
  message of ~2300 tokens of varied text (the context), then each turn the
  previous reply (as the server returned it) and a new ~130-token user message,
  16 tokens greedy with EOS banned: time to first token per turn on the three
  servers, in lockstep, each first in turn; the prompt tokens the backend reused
  (Status ``prompt_cache_reused_tokens``) and mlx_lm.server's ``cached_tokens``;
  the prompt cache's entries and bytes after the last chat. The same again as an
  agent's tool loop: tool results, each reply sent back as a tool call rendered
  from its parsed form, so only the prompt-end snapshot serves the next turn.
- Speculation: part 6's copy prompt (~250 tokens of code to return with one
  line fixed), 96 tokens greedy with EOS banned: decode tok/s with speculation
  auto (n-gram prompt lookup) and off, and the proposed and accepted tokens. The
  weights are random: the model doesn't copy, so prompt lookup finds only what
  its output happens to share with the prompt or repeat of itself. What a model
  that copies would get is measured in-process (``bench/rollback.py``).

Llama-family models are parts 1 and 4's: this part doesn't run them again.
"""

import importlib
import json
import logging
import random
import statistics
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import load as load_tokenizer

import backend_pb2 as pb
from bench.batching import grpc_stream, http_stream, mlx_lm_server
from bench.overhead import machine_header
from bench.rollback import rollback_lines, rollback_speculation
from bench.speculative import COPY, decode_rate
from mlx_backend.models.gguf import save_tokenizer
from mlx_backend.models.loading import default_model_path

logger = logging.getLogger(__name__)

EOS = 2
TURNS = 6
# The first message carries the context; the others add to it.
FIRST_TOKENS = 2300
USER_TOKENS = 130
REPLY_TOKENS = 16
COPY_TOKENS = 96
COPY_PACING = "cpu_pacing:off"
SEED = 38
CACHE_FIGURES = ("entries", "bytes")
# A chat whose replies come back as written, and an agent's tool loop, whose
# calls come back rendered again from their parsed form.
SCENARIOS = ("chat", "agent")

# The backend's sides of the chat: LoadModel options.
BACKENDS = {
    "on": (),
    "off": ("prompt_snapshots:false", "prefix_sharing:false"),
}
LABELS = {
    "on": "snapshots on",
    "off": "snapshots off",
    "mlx_lm": "mlx_lm.server",
}

# SmolLM2-135M's width and depth as Qwen3.5 nests a text model's config.
HYBRID_CONFIG = {
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        # Layers 3, 7, ..., 27 full attention; the others gated delta nets.
        "full_attention_interval": 4,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
        "tie_word_embeddings": True,
        "vocab_size": 49152,
        "eos_token_id": EOS,
    },
    "tie_word_embeddings": True,
    "eos_token_id": EOS,
}

# The words of the chat's varied text.
_WORDS = {
    "when": (
        "In the spring of 1874",
        "Early one Tuesday",
        "Long before the railway came",
        "During the winter storms",
        "After the harvest festival",
        "On the night of the eclipse",
        "Three days after the flood",
        "At dawn",
    ),
    "who": (
        "the old ferryman",
        "a young botanist from Ghent",
        "the mayor's clerk",
        "two weavers",
        "the lighthouse keeper's daughter",
        "a travelling glassblower",
        "the village schoolteacher",
        "a retired sea captain",
        "the baker's apprentice",
        "an astronomer with a cracked telescope",
    ),
    "did": (
        "counted",
        "repaired",
        "sketched",
        "carried",
        "argued about",
        "buried",
        "catalogued",
        "painted",
        "sold",
        "measured",
    ),
    "what": (
        "copper kettles",
        "maps of the estuary",
        "jars of quince jam",
        "broken clocks",
        "letters sealed with green wax",
        "bundles of lavender",
        "salt-stained ledgers",
        "iron lanterns",
        "wool blankets",
        "seeds of a rare orchid",
    ),
    "where": (
        "behind the granary",
        "on the north quay",
        "under the chapel stairs",
        "beside the frozen canal",
        "in the customs house",
        "at the edge of the marsh",
        "near the windmill",
        "inside the abandoned observatory",
    ),
    "why": (
        "because the river had risen again",
        "so that the council would finally listen",
        "while the church bells rang for noon",
        "although nobody had asked them to",
        "as the fog rolled in from the sea",
        "before the tax collector arrived",
        "since the old bridge had collapsed",
        "until the lamps were lit",
    ),
}


def make_hybrid_folder(folder: Path) -> Path:
    """The hybrid model saved in ``folder`` as mlx-lm saves models: mlx-lm's
    random initialization (seeded), float32, the default model's tokenizer."""
    module = importlib.import_module("mlx_lm.models.qwen3_5")
    mx.random.seed(SEED)
    model = module.Model(module.ModelArgs.from_dict(HYBRID_CONFIG))
    weights = dict(tree_flatten(model.parameters()))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    _, metadata = mx.load(str(default_model_path()), return_metadata=True)
    save_tokenizer(metadata, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    if not settings.get("chat_template"):
        raise RuntimeError("the default model's tokenizer has no chat template")
    (folder / "config.json").write_text(json.dumps(HYBRID_CONFIG, indent=2))
    return folder


def varied_text(rng: random.Random, tokenizer, tokens: int) -> str:
    """Sentences drawn at random from ``_WORDS``, at least ``tokens`` long."""
    sentences: list[str] = []
    while len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < tokens:
        pick = {part: rng.choice(words) for part, words in _WORDS.items()}
        count = rng.randint(2, 97)
        sentences.append(
            f"{pick['when']}, {pick['who']} {pick['did']} {count} {pick['what']} "
            f"{pick['where']} {pick['why']}."
        )
    return " ".join(sentences)


def user_messages(tokenizer) -> list[str]:
    """The chat's user messages: ``FIRST_TOKENS`` long, then ``USER_TOKENS``."""
    rng = random.Random(SEED)
    sizes = [FIRST_TOKENS] + [USER_TOKENS] * (TURNS - 1)
    return [varied_text(rng, tokenizer, size) for size in sizes]


@dataclass
class Turn:
    """One chat request: its time to first token, prompt tokens, reused prompt
    tokens, and the reply's text."""

    ttft_s: float
    prompt_tokens: int
    reused: int
    text: str


def status(stub) -> dict:
    return dict(stub.Status(pb.HealthMessage()).memory.breakdown)


def grpc_turn(stub, messages: list[dict]) -> Turn:
    before = status(stub)["prompt_cache_reused_tokens"]
    stream = grpc_stream(stub, messages, REPLY_TOKENS, EOS)
    reused = status(stub)["prompt_cache_reused_tokens"] - before
    return Turn(
        stream.arrivals[0] - stream.start, stream.prompt_tokens, reused, stream.text
    )


def http_turn(port: int, messages: list[dict]) -> Turn:
    stream = http_stream(port, "default_model", messages, REPLY_TOKENS, EOS)
    return Turn(
        stream.arrivals[0] - stream.start,
        stream.prompt_tokens,
        stream.cached_tokens,
        stream.text,
    )


def tool_call(t: int) -> str:
    """The call an agent's turn ``t`` made, as the frontend sends it back: parsed
    and rendered again, not the tokens the model wrote."""
    return f'<tool_call>{{"name": "search", "arguments": {{"page": {t}}}}}</tool_call>'


def run_chats(sides: dict, tokenizer, rounds: int, agent: bool) -> dict:
    """Each side's chat, turn by turn in lockstep, each side first in turn;
    ``{side: [[Turn per turn] per round]}``. An ``agent``'s turns after the first
    send a tool's result, after its call rendered again."""
    names = list(sides)
    runs: dict = {name: [] for name in names}
    users = user_messages(tokenizer)
    for r in range(rounds):
        # A new system prompt for every chat, so no cache serves its first turn;
        # tags of one length, so the sides' prompts are as long.
        histories = {
            name: [
                {"role": "system", "content": f"Chat {i}.{r}{int(agent)}. Be helpful."}
            ]
            for i, name in enumerate(names)
        }
        turns = {name: [] for name in names}
        for t in range(TURNS):
            k = (r * TURNS + t) % len(names)
            for name in names[k:] + names[:k]:
                logger.info(
                    "model families: %s on %s, round %d, turn %d",
                    "agent" if agent else "chat",
                    name,
                    r + 1,
                    t + 1,
                )
                history = histories[name]
                role = "tool" if agent and t else "user"
                history.append({"role": role, "content": users[t]})
                turn = sides[name](history)
                if turn.ttft_s is None:
                    raise RuntimeError(f"{name} returned no text on turn {t + 1}")
                reply = tool_call(t) if agent else turn.text
                history.append({"role": "assistant", "content": reply})
                turns[name].append(turn)
        for name in names:
            runs[name].append(turns[name])
    return runs


def summarize(runs: dict) -> list[dict]:
    """Per turn: the prompt's tokens, and each side's median TTFT and reuse."""
    summary = []
    for t in range(TURNS):
        row = {"prompt_tokens": runs["on"][0][t].prompt_tokens}
        for name, chats in runs.items():
            row[f"{name}_ttft_s"] = statistics.median(c[t].ttft_s for c in chats)
            row[f"{name}_reused"] = statistics.median(c[t].reused for c in chats)
            row[f"{name}_prompt_tokens"] = statistics.median(
                c[t].prompt_tokens for c in chats
            )
        summary.append(row)
    return summary


def copy_run(stub) -> tuple[float, int, int]:
    """Decode tok/s of the copy prompt, and the tokens proposed and accepted."""
    before = status(stub)
    rate = decode_rate(grpc_stream(stub, COPY, COPY_TOKENS, EOS))
    after = status(stub)
    return (
        rate,
        after["draft_tokens_proposed"] - before["draft_tokens_proposed"],
        after["draft_tokens_accepted"] - before["draft_tokens_accepted"],
    )


def bench_model_families(
    start_server, folder: str, rounds: int
) -> tuple[dict, list[str]]:
    """Args:
    start_server: ``bench.bench.running_server``: a context manager of a backend
        stub, given the LoadModel ``options`` and ``model``.
    folder: A temporary folder for the model and mlx_lm.server's log.
    """
    model = make_hybrid_folder(Path(folder) / "hybrid")
    tokenizer = load_tokenizer(model)
    with ExitStack() as stack:
        stubs = {
            name: stack.enter_context(start_server(model=str(model), options=options))
            for name, options in BACKENDS.items()
        }
        port = stack.enter_context(mlx_lm_server(str(model), folder))
        figures = status(stubs["on"])
        sides = {name: partial(grpc_turn, stub) for name, stub in stubs.items()}
        sides["mlx_lm"] = partial(http_turn, port)
        for side in sides.values():
            side([{"role": "user", "content": "Warm up."}])
        runs = {
            scenario: run_chats(sides, tokenizer, rounds, scenario == "agent")
            for scenario in SCENARIOS
        }
        # The prompt cache after the last chat (its newest entries, as many as
        # max_cache_entries keeps).
        cache = {
            name: {key: status(stub)[f"prompt_cache_{key}"] for key in CACHE_FIGURES}
            for name, stub in stubs.items()
        }
        # Speculation: both reloaded (an empty prompt cache) with the same step
        # pacing, which each load would otherwise measure and choose on its own;
        # the snapshots-off server without speculation.
        on, off = stubs["on"], stubs["off"]
        for stub, options in ((on, []), (off, ["speculative:off"])):
            options = [*options, COPY_PACING]
            request = pb.ModelOptions(Model=str(model), Options=options)
            assert stub.LoadModel(request).success
        copy_runs: dict = {"auto": [], "off": []}
        for stub in (on, off):
            copy_run(stub)  # warm up
        for r in range(2 * rounds):
            for name, stub in (("auto", on), ("off", off))[:: 1 if r % 2 else -1]:
                logger.info("model families: copy, speculation %s, run %d", name, r + 1)
                copy_runs[name].append(copy_run(stub))
        speculates = status(on)["speculative_decoding"]
    # After the servers are gone: the cores are the measurement's alone.
    prompt = tuple(tokenizer.encode(COPY))
    rollback = rollback_speculation(model, prompt, COPY_TOKENS, EOS, rounds)
    report = {
        "model": HYBRID_CONFIG,
        "kv_cache_layers": {
            k.split(".", 1)[1]: v
            for k, v in sorted(figures.items())
            if k.startswith("kv_cache_layers.")
        },
        "prompt_reuse_by": [
            k.split(".", 1)[1] for k in figures if k.startswith("prompt_reuse_by.")
        ],
        "turns": {scenario: summarize(runs[scenario]) for scenario in SCENARIOS},
        "runs": {
            scenario: {
                name: [[vars(turn) for turn in chat] for chat in chats]
                for name, chats in runs[scenario].items()
            }
            for scenario in SCENARIOS
        },
        "prompt_cache_after_chat": cache,
        "copy": {
            "runs": copy_runs,
            "auto_tok_s": statistics.median(rate for rate, _, _ in copy_runs["auto"]),
            "off_tok_s": statistics.median(rate for rate, _, _ in copy_runs["off"]),
            "proposed": sum(p for _, p, _ in copy_runs["auto"]),
            "accepted": sum(a for _, _, a in copy_runs["auto"]),
            "speculative_decoding": speculates,
        },
        "rollback_speculation": rollback,
    }
    return report, format_lines(report, figures, rounds)


def goal_row(goal: str, values: list[float], target: float, shown) -> str:
    met = "met" if min(values) >= target else "missed"
    return f"| {goal} | {shown(min(values))} | {shown(max(values))} | {met} |"


def chat_lines(title: str, turns: list[dict]) -> list[str]:
    """One scenario's table per turn, and its goals."""
    lines = [
        title,
        "",
        "| turn | prompt tokens | reused, snapshots on | snapshots off | mlx_lm "
        "| TTFT s, snapshots on | snapshots off | mlx_lm.server |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t, row in enumerate(turns, 1):
        prompt = row["prompt_tokens"]
        reused = [
            f"{row[f'{name}_reused']:.0f} "
            f"({row[f'{name}_reused'] / row[f'{name}_prompt_tokens']:.0%})"
            for name in ("on", "off", "mlx_lm")
        ]
        ttfts = [f"{row[f'{name}_ttft_s']:.2f}" for name in ("on", "off", "mlx_lm")]
        lines.append(f"| {t} | {prompt} | " + " | ".join(reused + ttfts) + " |")
    later = turns[1:]
    lines += [
        "",
        f"| goal, turns 2-{TURNS} | worst | best | |",
        "|---|---|---|---|",
        goal_row(
            "reused ≥ 90% of the prompt",
            [r["on_reused"] / r["on_prompt_tokens"] for r in later],
            0.9,
            "{:.0%}".format,
        ),
    ]
    for name in ("off", "mlx_lm"):
        lines.append(
            goal_row(
                f"TTFT ≥ 5x better than {LABELS[name]}",
                [r[f"{name}_ttft_s"] / r["on_ttft_s"] for r in later],
                5.0,
                "{:.1f}x".format,
            )
        )
    return lines


def format_lines(report: dict, figures: dict, rounds: int) -> list[str]:
    layers = ", ".join(f"{n} {name}" for name, n in report["kv_cache_layers"].items())
    reuse = "/".join(report["prompt_reuse_by"]) or "?"
    top = HYBRID_CONFIG["text_config"]
    lines = [
        f"## 10. Model families: a hybrid qwen3_5 of the default model's size "
        f"({rounds} rounds)",
        "",
        machine_header(figures),
        "",
        f"Random float32 weights, {top['hidden_size']} wide, "
        f"{top['num_hidden_layers']} layers (every {top['full_attention_interval']}th "
        f"full attention, the others gated delta nets); KV cache layers {layers}; "
        f"prompt reuse by {reuse}.",
        "",
        f"{TURNS} turns, a ~{FIRST_TOKENS}-token first message, then "
        f"~{USER_TOKENS} new tokens each turn after the previous reply, "
        f"{REPLY_TOKENS} tokens greedy, the servers in lockstep; medians. "
        f"Reused: prompt tokens the backend didn't prefill (mlx_lm.server: "
        f"cached_tokens), and their share of the prompt. Snapshots off: "
        f"{', '.join(BACKENDS['off'])} (prefix sharing keeps a long prompt's end "
        f"state too), which keeps each request's final state.",
        "",
    ]
    lines += chat_lines(
        "Chat: user messages, each reply sent back as the server wrote it.",
        report["turns"]["chat"],
    )
    lines += [""] + chat_lines(
        "Agent: tool results (role tool), each reply sent back as a tool call "
        "rendered again from its parsed form, not as written (mlx_lm.server keeps "
        "message boundaries only when the last message is the user's).",
        report["turns"]["agent"],
    )
    cache = report["prompt_cache_after_chat"]
    lines += [
        "",
        "The prompt cache after the last agent loop: "
        + ", ".join(
            f"{LABELS[name]} {c['entries']} entries, {c['bytes'] / 1e6:.1f} MB"
            for name, c in cache.items()
        )
        + ".",
    ]
    copy = report["copy"]
    shown = (
        f"{copy['accepted']}/{copy['proposed']} "
        f"({copy['accepted'] / copy['proposed']:.0%})"
        if copy["proposed"]
        else "none proposed"
    )
    lines += [
        "",
        f"| copy workload (part 6's prompt), {COPY_TOKENS} tokens, {COPY_PACING}, "
        f"median of {2 * rounds} runs | value | goal |",
        "|---|---|---|",
        f"| decode tok/s, speculation auto / off ({copy['auto_tok_s']:.1f} / "
        f"{copy['off_tok_s']:.1f}) | {copy['auto_tok_s'] / copy['off_tok_s']:.2f}x "
        f"| ≥ 1.5x |",
        f"| draft tokens accepted / proposed (speculative_decoding "
        f"{copy['speculative_decoding']}) | {shown} | |",
    ]
    lines += [""] + rollback_lines(report["rollback_speculation"])
    return lines
