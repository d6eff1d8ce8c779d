"""Part 9 of ``make bench``: chat formats. What classifying a reply (tool calls
streamed as JSON) costs per token in the reply pipeline, as the engine feeds it,
against the server's decode time per token, both measured in this run; and decode
under a ToolChoice "required" grammar against unconstrained decode, in alternating
rounds on one server without speculation (which a grammar turns off): on the
default weights (the model has no call format, so
the call is bare JSON) and on the Qwen-style chat folder of the same weights
(``<tool_call>`` framing), which takes another compute path."""

import json
import math
import statistics
import time
from pathlib import Path

import llguidance.numpy
from mlx_lm.tokenizer_utils import load as load_tokenizer

import backend_pb2 as pb
from mlx_backend.formats.grammars import tool_call_grammar
from mlx_backend.formats.registry import make_chat_format
from mlx_backend.grammar import GrammarCompiler
from mlx_backend.output.chat_output import OutputOptions
from mlx_backend.output.detokenizer import TokenBytes, make_token_bytes
from mlx_backend.output.reply_pipeline import ReplyPipeline
from mlx_backend.request_parsing import GenerationRequest
from tests.chat_models import FAMILIES, make_chat_folders
from tests.unit.test_chat_formats import WEATHER_TOOL
from tests.unit.test_format_grammars import CALLS

# A tool whose one argument can't close within the decode: every token is constrained.
STORY_TOOL = {
    "type": "function",
    "function": {
        "name": "write_story",
        "parameters": {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 4000}},
            "required": ["story"],
        },
    },
}


def parse_seconds(folder: Path, text: str, classify: bool, repeats: int) -> float:
    """Seconds per token the reply pipeline takes for ``text``'s tokens."""
    tokenizer = load_tokenizer(folder)
    chat_format = make_chat_format(tokenizer, {})
    tokens = tokenizer.encode(text, add_special_tokens=False) * repeats
    options = OutputOptions(classify=classify, tools=[WEATHER_TOOL])
    request = GenerationRequest(
        prompt=(1,), max_tokens=len(tokens) + 1, ignore_eos=True, output=options
    )
    pipeline = ReplyPipeline(request, tokenizer, chat_format, TokenBytes(()))
    started = time.perf_counter()
    for token in tokens:
        pipeline.add(token)
    pipeline.finish("stop")
    return (time.perf_counter() - started) / len(tokens)


def decode_rate(stub, tokens: int, required: bool) -> float:
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role="user", content="Write a story.")],
        Tools=json.dumps([STORY_TOOL]),
        ToolChoice='"required"' if required else '"none"',
        Tokens=tokens,
        IgnoreEOS=not required,
        Metadata={"enable_thinking": "false"},
    )
    reply = stub.Predict(request)
    return reply.tokens / (reply.timing_token_generation / 1000.0)


def grammar_rates(stub, rounds: int, tokens: int) -> tuple[float, float, float]:
    """Median free and required tok/s, and the median of their ratio by round."""
    free, required, ratios = [], [], []
    for _ in range(rounds):
        free.append(decode_rate(stub, tokens, False))
        required.append(decode_rate(stub, tokens, True))
        ratios.append(required[-1] / free[-1])
    return (
        statistics.median(free),
        statistics.median(required),
        statistics.median(ratios),
    )


# A call whose string argument runs long, so that the mask's cost inside a value
# weighs as much as at the structure.
LONG_CITY = {"city": "Paris, the capital of France, on the Seine, " * 4, "days": 3}
# The families whose forced-call grammars part 9 times, one per kind of framing.
MASKED_FAMILIES = ("json", "qwen3_coder", "lfm2", "gemma4", "kimi_k2")


def mask_seconds(compiled, tokens: list[int], vocab: int) -> float:
    """Seconds per token a grammar's matcher takes: the mask, then the token."""
    matcher = compiled.matcher.deep_copy()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    started = time.perf_counter()
    for token in tokens:
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
        assert matcher.consume_token(token)
    return (time.perf_counter() - started) / len(tokens)


def grammar_mask_costs(folders: dict, rounds: int) -> dict[str, tuple[float, float]]:
    """Per family: µs per token of its forced-call grammar (declared keys, bounded
    whitespace) on a long call, and of the same call under an open JSON schema
    (any key, any whitespace) where the arguments are JSON, else nan."""
    costs = {}
    for name in MASKED_FAMILIES:
        tokenizer = load_tokenizer(folders[name])
        chat_format = make_chat_format(tokenizer, {})
        vocab = len(tokenizer.vocab)
        compiler = GrammarCompiler(tokenizer, make_token_bytes(tokenizer), vocab)
        text = CALLS[name](LONG_CITY)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        lark = tool_call_grammar(
            chat_format, [WEATHER_TOOL], None, "answer", compiler.specials
        )
        strict = compiler.compile(lark, lark=True)
        open_cost = math.nan
        if name == "json":
            schema = json.dumps(WEATHER_TOOL["function"]["parameters"])
            head = json.dumps('<tool_call>\n{"name": "get_weather", "arguments": ')
            tail = json.dumps("}\n</tool_call>")
            loose = f"start: {head} args {tail}\nargs: %json {schema}\n"
            compiled = compiler.compile(loose, lark=True)
            open_cost = statistics.median(
                mask_seconds(compiled, tokens, vocab) for _ in range(rounds)
            )
        costs[name] = (
            statistics.median(
                mask_seconds(strict, tokens, vocab) for _ in range(rounds)
            ),
            open_cost,
        )
    return costs


def bench_chat_formats(stub, folder: str, rounds: int, tokens: int):
    """``stub``: a server with the default model loaded, which part 9 reloads."""
    folders = make_chat_folders(Path(folder) / "chat")
    reply = FAMILIES["hermes_3"].replies[0].text + " It is sunny in Paris today. "
    plain = statistics.median(
        parse_seconds(folders["json"], reply, False, 20) for _ in range(rounds)
    )
    classified = statistics.median(
        parse_seconds(folders["json"], reply, True, 20) for _ in range(rounds)
    )
    paths = {}
    for name, model in (("default weights", "default"), ("chat folder", "json")):
        model = model if model == "default" else str(folders[model])
        # As in part 1, without speculation, which a grammar turns off.
        options = ["speculative:off"]
        assert stub.LoadModel(pb.ModelOptions(Model=model, Options=options)).success
        paths[name] = grammar_rates(stub, rounds, tokens)
    decode = 1.0 / paths["default weights"][0]
    cost = (classified - plain) / decode
    masks = grammar_mask_costs(folders, rounds)
    report = {
        "decode_ms_per_token": decode * 1e3,
        "pipeline_us_per_token_raw": plain * 1e6,
        "pipeline_us_per_token_classified": classified * 1e6,
        "format_cost_of_decode": cost,
        "required_tool_choice": {
            name: {"free_tok_s": free, "required_tok_s": required, "ratio": ratio}
            for name, (free, required, ratio) in paths.items()
        },
        "call_grammar_us_per_token": {
            name: {"strict": strict * 1e6, "open_json": loose * 1e6}
            for name, (strict, loose) in masks.items()
        },
    }
    lines = [
        f"## 9. Chat formats ({rounds} rounds, {tokens} tokens)",
        "",
        "| measure | value | goal |",
        "|---|---|---|",
        f"| server decode, default weights, ms per token | {decode * 1e3:.1f} | |",
        f"| reply pipeline, raw text, µs per token | {plain * 1e6:.1f} | |",
        f"| reply pipeline, a reply with two calls classified, µs per token | "
        f"{classified * 1e6:.1f} | |",
        f"| format handling / decode | {cost:.2%} | ≤ 2% |",
    ]
    for name, (free, required, ratio) in paths.items():
        lines.append(
            f"| {name}: ToolChoice required / free decode "
            f"({required:.1f} / {free:.1f} tok/s) | {ratio:.3f}x | ≥ 0.95x |"
        )
    for name, (strict, loose) in masks.items():
        against = "" if math.isnan(loose) else f" (open schema: {loose * 1e6:.0f} µs)"
        lines.append(
            f"| {name}: forced-call grammar's mask, µs per token, of decode"
            f"{against} | {strict * 1e6:.0f} µs, {strict / decode:.2%} | |"
        )
    return report, lines
