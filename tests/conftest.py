"""pytest's hooks and shared fixtures. The helpers they use are in
``tests/support.py`` (the backend process, which bench/ uses too) and
``tests/chat_models.py``.

Each test lives in the folder of its kind, which marks it: ``tests/unit`` (fakes,
pure functions and tiny models), ``tests/engine`` (an in-process engine on the
default model) or ``tests/e2e`` (a backend process on a real port). A test
elsewhere must carry one of those markers itself (the root's test_mlx_cache.py is
``unit``); one with no kind, or two, stops the run, so that ``-m unit``,
``-m engine`` and ``-m e2e`` split the suite.
"""

import fcntl
import hashlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

import backend_pb2 as pb
from mlx_backend.cpu.activations import ACTIVATIONS_ENV
from mlx_backend.cpu.blas import BLAS_THREAD_ENV, physical_cores
from mlx_backend.cpu.kernels import load_kernels
from mlx_backend.cpu.pacing import CPU_PACING_ENV
from mlx_backend.formats.registry import adopt_chat_format
from mlx_backend.models.gguf import gguf_tokenizer
from mlx_backend.models.loading import default_model_path
from tests.chat_models import make_chat_folders
from tests.family_models import make_family_folder
from tests.support import Server, start_default_server
from tests.tiny_models import make_short_default

KINDS = ("unit", "engine", "e2e")
TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    # Engines and backends under test don't spend ~2.5 s measuring pacing at every
    # load: the host setting pins it (greedy tokens are the same either way). Pacing
    # tests ask for auto; bench/, which imports tests/support.py, measures.
    os.environ.setdefault(CPU_PACING_ENV, "off")
    # Nor the kernels' activations: float32 pins the logprobs that the tests compare
    # with mlx-lm's (int8 moves them a little, near ties may part); the int8 tests
    # ask for it, and the choice's own tests for auto.
    os.environ.setdefault(ACTIVATIONS_ENV, "float32")
    # xdist's workers split the cores: BLAS threads beyond a worker's share spin
    # against the other worker's (make test on 2 cores: 8m24s, 6m48s split).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = str(max(1, physical_cores() // workers))
        for name in BLAS_THREAD_ENV:
            os.environ.setdefault(name, share)


# xdist's workers (pyproject.toml: -n auto). A run that may start backend processes
# gets a third: it runs while the others wait on theirs (make test on 2 cores: the
# same CPU time in 321 s rather than 341-361 s). The unit and engine layers run in
# their processes, where a third only adds its start (pytest -m unit: 24 s to 30 s).
WORKERS, IN_PROCESS_WORKERS = 3, 2


def pytest_xdist_auto_num_workers(config) -> int:
    markers = config.getoption("markexpr") or ""
    in_process = markers and "e2e" not in markers
    return IN_PROCESS_WORKERS if in_process else WORKERS


def folder_kind(path: Path) -> str | None:
    """``unit``, ``engine`` or ``e2e`` for a file under that folder of tests/."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in KINDS else None


# xdist (--dist loadgroup, pyproject.toml) hands each worker a whole group: a file,
# or these files together, which share what a worker builds once (the chat
# tokenizers and the forcing backend).
GROUPS = {
    "chat": (
        "unit/test_chat_formats.py",
        "unit/test_chat_output.py",
        "unit/test_format_grammars.py",
        "e2e/test_chat_formats.py",
        "e2e/test_chat_output.py",
        "e2e/test_format_grammars.py",
    ),
}
# The groups that take longest (docs/testing.md), handed out first so that the two
# workers finish together; the rest follow in collection order.
FIRST = (
    "chat",
    "e2e/test_distributed.py",
    "engine/test_speculative.py",
    "engine/test_model_families.py",
    "e2e/test_server.py",
    "engine/test_lora_families.py",
    "engine/test_engine.py",
    "engine/test_load_options.py",
    "e2e/test_grammar.py",
    "e2e/test_distributed_families.py",
    "e2e/test_logprobs_score_embedding.py",
)


# The engine layer's slower half, marked ``slow``: make test-quick leaves it out.
SLOW = (
    "engine/test_speculative.py",
    "engine/test_model_families.py",
    "engine/test_lora_families.py",
    "engine/test_engine.py",
    "engine/test_load_options.py",
)


def group_of(path: Path) -> str:
    """The xdist group of a test file: GROUPS' name, else its path under tests/."""
    try:
        name = path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return path.name
    return next((g for g, files in GROUPS.items() if name in files), name)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Marks each test by its folder and its xdist group, the longest groups first;
    a test with no kind, or with two, is a usage error that names it."""
    groups = {item.path: group_of(item.path) for item in items}
    rank = {group: i for i, group in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(groups[item.path], len(FIRST)))
    wrong = []
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.path]))
        if groups[item.path] in SLOW:
            item.add_marker(pytest.mark.slow)
        kind = folder_kind(item.path)
        if kind is not None:
            item.add_marker(kind)
        marked = {k for k in KINDS if item.get_closest_marker(k) is not None}
        if len(marked) != 1:
            kinds = " and ".join(sorted(marked)) if marked else "no kind"
            wrong.append(f"  {item.nodeid} ({kinds})")
    if wrong:
        folders = ", ".join(f"tests/{k}/" for k in KINDS)
        message = (
            f"every test is of one kind: it lives in {folders} or carries one of "
            f"the markers {', '.join(KINDS)}. These are not:\n" + "\n".join(wrong)
        )
        if hasattr(config, "workerinput"):
            # An xdist worker's usage error never reaches the terminal (the run
            # ends in an INTERNALERROR); a worker that runs nothing and asks to
            # stop has the controller end the run with this message.
            config.hook.pytest_deselected(items=list(items))
            items.clear()
            session.shouldstop = message
            return
        raise pytest.UsageError(message)


@pytest.fixture(scope="module")
def qmm():
    """The CPU kernels' extension, reset to its defaults after the module. On Linux
    CPU ``make install`` builds it, so missing it there fails; elsewhere (Metal,
    CUDA) the tests skip."""
    module, why = load_kernels()
    if module is None:
        if sys.platform == "linux" and mx.default_device() == mx.cpu:
            pytest.fail(f"the CPU kernels are missing: {why}")
        pytest.skip(why)
    yield module
    module.set_isa("auto")
    module.set_fused_isa("auto")
    module.set_activations("float32")
    module.use_sgemm(True)
    module.set_threads(2)


@pytest.fixture(scope="session")
def default_backend():
    """This worker's backend serving the default model, started once; the modules
    that use it get it through ``server``."""
    srv = start_default_server()
    srv.modules = 0
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(default_backend):
    """The worker's default backend with a fresh load of the default model (an
    empty prompt cache, the default options) for each module after the first."""
    if default_backend.modules:
        assert default_backend.stub.LoadModel(pb.ModelOptions(Model="default")).success
    default_backend.modules += 1
    return default_backend


@pytest.fixture(scope="session")
def forcing_backend():
    """This worker's forcing backend (tests/forcing_backend.py), started once with
    no model; the modules that use it get it through ``forcing_server``."""
    srv = Server(forcing=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def forcing_server(forcing_backend):
    """The worker's forcing backend; ``test_model`` names the model a module last
    loaded on it (None: load before use)."""
    forcing_backend.test_model = None
    return forcing_backend


@pytest.fixture(scope="module")
def bare_server():
    """No model loaded and bearer auth on (``AUTH`` passes it)."""
    srv = Server(env={"LOCALAI_GRPC_AUTH_TOKEN": "s3cret"})
    yield srv
    srv.stop()


def built_once(tmp_path_factory, name: str, build: Callable, *args, **kwargs) -> Path:
    """The folder ``build(folder, *args, **kwargs)`` writes, built once per run
    and shared by the xdist workers: under the run's common temporary folder,
    named by ``name`` and a hash of the source of the module that defines
    ``build``; one worker builds it while the other waits on a lock."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    source = inspect.getsource(inspect.getmodule(build))
    key = hashlib.sha256(source.encode()).hexdigest()[:12]
    folder = root / "built" / f"{name}-{key}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = Path(f"{folder}.done")
        if not done.exists():
            build(folder, *args, **kwargs)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def family_folder(tmp_path_factory) -> Callable[[str], Path]:
    """``family_folder(name)``: tests/family_models.py's tiny model of family
    ``name``, saved once per run."""
    return lambda name: built_once(
        tmp_path_factory, f"family-{name}", make_family_folder, name
    )


@pytest.fixture(scope="session")
def tiny_llama(family_folder) -> Path:
    """The family matrix's llama: 2 layers of random weights made lively (its greedy
    text follows the whole prompt, so a cache state one token off changes it), with
    the default model's tokenizer and chat template: for tests of mechanics, not of
    what the weights say."""
    return family_folder("llama")


@pytest.fixture(scope="session")
def short_default(tmp_path_factory) -> Path:
    """The default model's first 4 layers (tests/tiny_models.py), saved once per run:
    its shapes and quantization for tests that need them, not its answers."""
    return built_once(tmp_path_factory, "short-default", make_short_default)


@pytest.fixture(scope="session")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The chat models by template name (``json``, ``open``, ``coder``, each
    family's): a tiny random llama with reasoning and tool-call markers. The
    parser's tests and the structured-output server's share them."""
    root = built_once(tmp_path_factory, "chat-models", make_chat_folders)
    return {p.name: p for p in root.iterdir() if p.is_dir()}


@pytest.fixture(scope="session")
def chat_models(folders) -> Callable:
    """``chat_models(name)``: chat folder ``name``'s tokenizer and its chat format
    adopted as a load adopts it, loaded once per worker and shared."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            tokenizer = load_tokenizer(folders[name])
            config = json.loads((folders[name] / "config.json").read_text())
            loaded[name] = tokenizer, adopt_chat_format(tokenizer, config)
        return loaded[name]

    return load


@pytest.fixture(scope="session")
def chat_tokenizer(chat_models):
    """The ``json`` chat model's tokenizer."""
    return chat_models("json")[0]


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, built as load_gguf builds it, without the model."""
    _, metadata = mx.load(str(default_model_path()), return_metadata=True)
    return gguf_tokenizer(metadata)
