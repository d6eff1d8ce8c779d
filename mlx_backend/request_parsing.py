"""Request parsing: each RPC's proto parsed once into a frozen request for the engine."""

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mlx_backend.caches.prompt_files import confine
from mlx_backend.errors import FailedPrecondition, InvalidArgument
from mlx_backend.formats.base import ChatFormat, tool_names
from mlx_backend.formats.grammars import (
    closing_texts,
    has_call_grammar,
    reasoning_prefix,
    tool_call_grammar,
)
from mlx_backend.formats.registry import FRAMINGS
from mlx_backend.formats.rerank import RERANKER_FORMS, relevance
from mlx_backend.grammar import CompiledGrammar
from mlx_backend.models.loading import DEFAULT_MODEL_REF, LoadPlan, ModelInfo
from mlx_backend.models.lora import make_adapters
from mlx_backend.output.chat_output import OutputOptions, find_reply_start
from mlx_backend.refusals import describe_path
from python_utils import (
    MAX_DRAFT_TOKENS,
    TemplateArgs,
    apply_cache_types,
    arguments_as_text,
    check_sampling,
    convert_messages,
    encode_prompt,
    parse_logit_bias,
    parse_logprobs,
    parse_options,
    parse_template_args,
    parse_tool_choice,
    parse_tools,
    render_chat,
    tools_into_system,
)

logger = logging.getLogger(__name__)

# The prompt's last tokens, which show whether it opens thinking or a header.
PROMPT_TAIL_TOKENS = 32


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_context_size: int = 64
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptFile:
    """``PromptCachePath``: a file the prompt's KV state is restored from, and
    saved to once the request is served."""

    path: Path
    # PromptCacheAll: save the generated tokens' state too.
    everything: bool = False
    # PromptCacheRO: restore only, never write.
    read_only: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One parsed generation request, ready for the engine thread."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    output: OutputOptions = OutputOptions()
    # Logprobs with this many alternatives per token; None: no logprobs.
    logprobs: int | None = None
    grammar: CompiledGrammar | None = None
    # Logits processors run after the request's own, the grammar included: a hook
    # for constraints that no request field expresses (tests force tokens with it).
    processors: tuple[Callable, ...] = ()
    # Proposed tokens a speculative step may verify (NDraft); None: the load option.
    draft_tokens: int | None = None
    # The load the prompt was tokenized for; a request for a replaced model is refused.
    load_id: int = 0
    prompt_file: PromptFile | None = None


@dataclass(frozen=True)
class EmbeddingRequest:
    """One parsed Embedding request: the tokens to embed."""

    tokens: tuple[int, ...]
    load_id: int = 0


@dataclass(frozen=True)
class ScoreRequest:
    """One parsed Score request: candidates to score after a prompt."""

    prompt: tuple[int, ...]
    candidates: tuple[tuple[int, ...], ...]
    load_id: int = 0


def _pick(requested, default, fallback):
    """A request field overrides the LoadModel option; proto3's zero means unset."""
    if requested:
        return requested
    return fallback if default is None else default


# The PredictOptions field of each checked sampling value.
SAMPLING_FIELDS = {
    "temperature": "Temperature",
    "top_p": "TopP",
    "min_p": "MinP",
    "repetition_penalty": "Penalty",
    "frequency_penalty": "FrequencyPenalty",
    "presence_penalty": "PresencePenalty",
}


def parse_sampling(request, info: ModelInfo) -> SamplingParams:
    opts = info.options
    values = {
        name: _pick(
            check_sampling(field, name, getattr(request, field)),
            getattr(opts, name),
            0.0,
        )
        for name, field in SAMPLING_FIELDS.items()
    }
    if request.TopK < 0:
        raise InvalidArgument("TopK must not be negative")
    top_k = _pick(request.TopK, opts.top_k, 0)
    return SamplingParams(
        **values,
        # Keeping the whole vocabulary or more filters nothing.
        top_k=top_k if top_k < info.vocab_size else 0,
        repetition_context_size=opts.repetition_context_size,
        seed=request.Seed if request.Seed >= 0 else None,
        logit_bias=parse_logit_bias(request.LogitBias, info.vocab_size),
    )


def is_chat(request) -> bool:
    return bool(request.UseTokenizerTemplate and request.Messages)


def parse_prompt(request, info: ModelInfo) -> tuple[list[int], TemplateArgs]:
    """Prompt token ids (the chat template over ``Messages``, or ``Prompt`` as given),
    and the template arguments (of a raw prompt: only its tools)."""
    if is_chat(request):
        args = parse_template_args(
            request.Tools,
            request.ToolChoice,
            dict(request.Metadata),
            info.options.enable_thinking,
        )
        messages = convert_messages(request.Messages)
        messages = adapt_messages(messages, args.tools, info.chat_format)
        return render_chat(info.tokenizer, messages, args), args
    # Malformed Tools is refused whatever the prompt.
    tools = parse_tools(request.Tools)
    return encode_prompt(info.tokenizer, request.Prompt), TemplateArgs(tools=tools)


def adapt_messages(
    messages: list[dict], tools: list | None, chat_format: ChatFormat
) -> list[dict]:
    """``messages`` as the family's template reads them."""
    if tools and chat_format.tools_in_system:
        messages = tools_into_system(messages, tools)
    if chat_format.arguments_as_text:
        messages = arguments_as_text(messages)
    return messages


def parse_output(
    request, info: ModelInfo, prompt: list[int], args: TemplateArgs
) -> OutputOptions:
    """How the reply is classified, as the model marks it up: chat requests, and raw
    prompts (LocalAI's Go templates) that carry Tools or end inside thinking."""
    tail = info.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:])
    start = find_reply_start(info.chat_format, tail)
    if not is_chat(request) and not args.tools and start.state == "content":
        return OutputOptions()  # a plain completion: raw text
    return OutputOptions(
        classify=True,
        start=start,
        parse_tool_calls=parse_tool_choice(request.ToolChoice) != "none",
        tools=args.tools,
    )


# ToolChoice modes that make the reply a call.
CALL_REQUIRED = ("required", "any")


def parse_grammar(
    request, info: ModelInfo, args: TemplateArgs, output: OutputOptions
) -> tuple[CompiledGrammar | None, OutputOptions]:
    """The reply's grammar: ``Grammar`` for the answer after any reasoning, or with
    ToolChoice "required" or a named function, a call in the model's framing."""
    compiler = info.grammars
    chat_format = info.chat_format
    # Where the reply starts, for the grammar ("answer": no reasoning to come).
    start = "answer" if output.start.reasoned else output.start.state
    reasoning = ""
    if output.classify:
        reasoning = reasoning_prefix(chat_format, start, compiler.specials)
    closers = closing_texts(chat_format) if output.classify else ()
    if request.Grammar:
        return compiler.compile(request.Grammar, reasoning, closers=closers), output
    choice = parse_tool_choice(request.ToolChoice)
    if isinstance(choice, dict):
        function = choice.get("function", choice)
        name = function.get("name") if isinstance(function, dict) else None
        if name not in (tool_names(args.tools) or ()):
            raise InvalidArgument(
                f"ToolChoice: the function {name!r} is not one of the Tools"
            )
    elif choice in CALL_REQUIRED and args.tools:
        name = None
    else:
        return None, output
    if not has_call_grammar(chat_format):
        raise FailedPrecondition(
            f"ToolChoice: this model's tool calls ({chat_format.tools.name}) have no "
            'grammar here, so a call can\'t be forced; use "auto"'
        )
    lark = tool_call_grammar(
        chat_format,
        args.tools,
        name,
        start if output.classify else "content",
        compiler.specials,
    )
    if lark is None:
        return None, output  # no tool has a name
    if chat_format.tools is None and chat_format.channels is None:
        # A model without a call format of its own answers with the call's JSON.
        bare = dataclasses.replace(chat_format, tools=FRAMINGS["llama3_json"])
        output = dataclasses.replace(output, chat_format=bare)
    return compiler.compile(lark, lark=True, closers=closers), output


def parse_generation(request, info: ModelInfo) -> GenerationRequest:
    """Parse ``PredictOptions`` once into the engine's request type."""
    sampling = parse_sampling(request, info)
    prompt, args = parse_prompt(request, info)
    if not prompt:
        raise InvalidArgument("Prompt: the prompt is empty (set Prompt or Messages)")
    room = info.context_size - len(prompt)
    if room <= 0:
        raise InvalidArgument(
            f"Prompt: the prompt has {len(prompt)} tokens, which does not fit the "
            f"context size of {info.context_size} tokens"
        )
    limit = request.Tokens if request.Tokens > 0 else info.options.max_tokens
    if not 0 <= request.NDraft <= MAX_DRAFT_TOKENS:
        raise InvalidArgument(f"NDraft must be between 0 and {MAX_DRAFT_TOKENS}")
    output = parse_output(request, info, prompt, args)
    grammar, output = parse_grammar(request, info, args, output)
    return GenerationRequest(
        prompt=tuple(prompt),
        max_tokens=min(limit or room, room),
        sampling=sampling,
        stop=tuple(s for s in request.StopPrompts if s),
        ignore_eos=request.IgnoreEOS,
        output=output,
        logprobs=parse_logprobs(request.Logprobs, request.TopLogprobs),
        grammar=grammar,
        draft_tokens=request.NDraft or None,
        load_id=info.load_id,
        prompt_file=parse_prompt_file(request, info),
    )


def parse_prompt_file(request, info: ModelInfo) -> PromptFile | None:
    if not request.PromptCachePath:
        return None
    return PromptFile(
        confine(request.PromptCachePath, info.prompt_file_roots),
        everything=request.PromptCacheAll,
        read_only=request.PromptCacheRO,
    )


def check_tokens(field: str, tokens: Iterable[int], info: ModelInfo) -> None:
    for i, token in enumerate(tokens):
        if not 0 <= token < info.vocab_size:
            raise InvalidArgument(
                f"{field}[{i}]: {token} is outside the vocabulary "
                f"(0..{info.vocab_size - 1})"
            )


def check_fits(field: str, length: int, info: ModelInfo) -> None:
    if length > info.context_size:
        raise InvalidArgument(
            f"{field}: {length} tokens do not fit the context size of "
            f"{info.context_size} tokens"
        )


def parse_embedding(request, info: ModelInfo) -> EmbeddingRequest:
    """The tokens to embed: ``EmbeddingTokens`` as given, or ``Embeddings`` encoded."""
    if not info.embeddings:
        raise FailedPrecondition(
            "Embedding: this model's architecture does not expose its hidden states"
        )
    if request.EmbeddingTokens:
        tokens = list(request.EmbeddingTokens)
        check_tokens("EmbeddingTokens", tokens, info)
        field = "EmbeddingTokens"
    else:
        # Checked before encoding: a tokenizer that adds BOS never gives nothing.
        text = request.Embeddings
        tokens = encode_prompt(info.tokenizer, text) if text else []
        field = "Embeddings"
    if not tokens:
        raise InvalidArgument(
            "Embeddings: the input is empty (set Embeddings or EmbeddingTokens)"
        )
    check_fits(field, len(tokens), info)
    return EmbeddingRequest(tokens=tuple(tokens), load_id=info.load_id)


def parse_score(request, info: ModelInfo) -> ScoreRequest:
    """The prompt's tokens, and each candidate's, encoded without special tokens."""
    if not request.candidates:
        raise InvalidArgument("candidates: the list is empty")
    for i, candidate in enumerate(request.candidates):
        if not candidate:
            raise InvalidArgument(f"candidates[{i}]: the candidate is empty")
    if not request.prompt:
        raise InvalidArgument("prompt: the prompt is empty")
    prompt = encode_prompt(info.tokenizer, request.prompt)
    candidates = []
    for i, candidate in enumerate(request.candidates):
        tokens = info.tokenizer.encode(candidate, add_special_tokens=False)
        if not tokens:
            raise InvalidArgument(f"candidates[{i}]: the candidate has no tokens")
        check_fits(f"candidates[{i}]", len(prompt) + len(tokens), info)
        candidates.append(tuple(tokens))
    return ScoreRequest(
        prompt=tuple(prompt),
        candidates=tuple(candidates),
        load_id=info.load_id,
    )


@dataclass(frozen=True)
class JudgeRequest:
    """Documents judged after one shared prefix (the judging prompt, instruction
    and query): each document's tokens after it, and the two answers whose
    logprobs are read at each document's last token."""

    prefix: tuple[int, ...]
    documents: tuple[tuple[int, ...], ...]
    answers: tuple[int, int]
    load_id: int = 0


@dataclass(frozen=True)
class RerankJob:
    """A parsed Rerank: the documents' texts, the judging the engine runs, and how
    many results to give."""

    texts: tuple[str, ...]
    judge: JudgeRequest
    top_n: int

    @property
    def prompt_tokens(self) -> int:
        """Every document's whole prompt, counted as if prefilled alone."""
        judge = self.judge
        return len(judge.prefix) * len(judge.documents) + sum(map(len, judge.documents))

    def ranked(self, answers: list[tuple[float, float]]) -> list[tuple[int, float]]:
        """(index, relevance) of the best ``top_n`` documents (0, or more than
        there are: all) from each document's answer logprobs, best first, ties by
        index."""
        ranks = [(i, relevance(yes, no)) for i, (yes, no) in enumerate(answers)]
        ranks.sort(key=lambda pair: (-pair[1], pair[0]))
        return ranks[: self.top_n] if 0 < self.top_n < len(ranks) else ranks


# What ``Engine.compute`` runs a chunk at a time between decode steps.
ComputeRequest = EmbeddingRequest | ScoreRequest | JudgeRequest


def parse_rerank(request, info: ModelInfo) -> RerankJob:
    """Each document's prompt in the model's reranker form (the document cut to
    fit the context, never the query), split into the prefix every prompt shares
    and each document's own tokens."""
    form = info.reranker
    if form is None:
        raise FailedPrecondition(
            "Rerank: the loaded model is not a reranker (the LoadModel option "
            f"reranker: one of {', '.join(RERANKER_FORMS)} makes it one)"
        )
    if not request.query.strip():
        raise InvalidArgument("query: the query is empty")
    if not request.documents:
        raise InvalidArgument("documents: the list is empty")
    if request.top_n < 0:
        raise InvalidArgument("top_n: must not be negative")
    tokenizer = info.tokenizer
    prompts = []
    room = info.context_size - 1  # the answer's position
    for i, document in enumerate(request.documents):
        prompt = encode_prompt(tokenizer, form.text(request.query, document))
        if len(prompt) > room:
            cut = _cut_document(tokenizer, form, request.query, document, room)
            logger.info(
                "documents[%d]: %d tokens cut to fit the context of %d",
                i,
                len(prompt) - len(cut),
                info.context_size,
            )
            prompt = cut
        prompts.append(prompt)
    # Every document keeps one token of its own, where its answer is read.
    shared = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)
    judge = JudgeRequest(
        prefix=tuple(prompts[0][:shared]),
        documents=tuple(tuple(p[shared:]) for p in prompts),
        answers=(form.yes, form.no),
        load_id=info.load_id,
    )
    return RerankJob(tuple(request.documents), judge, request.top_n)


def _cut_document(tokenizer, form, query: str, document: str, room: int) -> list:
    """The prompt with the document's last tokens cut until it fits ``room``."""
    words = tokenizer.encode(document, add_special_tokens=False)
    keep = len(words)
    while True:
        text = form.text(query, tokenizer.decode(words[:keep]))
        prompt = encode_prompt(tokenizer, text)
        if len(prompt) <= room:
            return prompt
        if keep == 0:
            raise InvalidArgument(
                f"query: with the judging prompt it takes {len(prompt)} tokens, "
                f"leaving no room for a document in the context of {room + 1}"
            )
        keep = max(0, keep - (len(prompt) - room))


def parse_load(request) -> LoadPlan:
    """``ModelOptions`` parsed once into the engine's load plan."""
    options = parse_options(request.Options)
    options = apply_cache_types(options, request.CacheTypeKey, request.CacheTypeValue)
    if request.Threads < 0:
        raise InvalidArgument("Threads must not be negative")
    if request.Threads:
        options = dataclasses.replace(options, threads=request.Threads)
    if request.Reranking and not options.reranker:
        # LocalAI's `reranking: true`: the judging prompt through the chat template.
        options = dataclasses.replace(options, reranker="yes_no")
    check_prompt_cache_dir(options.prompt_cache_dir)
    adapters = make_adapters(
        request.LoraAdapter,
        request.LoraScale,
        request.LoraAdapters,
        request.LoraScales,
        request.ModelPath,
    )
    return LoadPlan(
        model="" if request.Model == DEFAULT_MODEL_REF else request.Model,
        identity=request.Model,
        model_file=request.ModelFile,
        model_path=request.ModelPath,
        draft=request.DraftModel,
        adapters=adapters,
        options=options,
        context_size=request.ContextSize,
    )


def check_prompt_cache_dir(folder: str) -> None:
    """The option prompt_cache_dir names a folder (created on the first write);
    anything else is described, never read."""
    if folder and Path(folder).exists() and not Path(folder).is_dir():
        raise InvalidArgument(
            f"Options: prompt_cache_dir: {folder} is {describe_path(Path(folder))}, "
            "not a folder"
        )
