"""What is wrong with a model folder or a chat template, said without quoting them.

mlx-lm, transformers and jinja report a bad file with a snippet of it; a load names
the problem from these checks instead (see ``mlx_backend.refusals``).
"""

import json
import logging
from importlib import metadata
from pathlib import Path

from jinja2 import meta, nodes
from jinja2.exceptions import TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from mlx_lm.utils import _get_classes

from mlx_backend.refusals import Described, read_json

logger = logging.getLogger(__name__)

# A safetensors header larger than this is taken as garbage.
MAX_HEADER_BYTES = 100 << 20


class TemplateRefused(Described):
    """A chat template that is not valid Jinja, or not a chat template at all."""


class _Generation(Extension):
    """Parses transformers' ``{% generation %}`` block, so that templates using it
    are valid here too; only parsed, never rendered."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


_ENVIRONMENT = ImmutableSandboxedEnvironment(
    extensions=["jinja2.ext.loopcontrols", _Generation]
)


def chat_templates(tokenizer) -> list[str]:
    """The tokenizer's chat templates as text: one, or each of its named ones."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return [template]
    if isinstance(template, dict):
        return [t for t in template.values() if isinstance(t, str)]
    if isinstance(template, list):
        # The older list form: [{"name": ..., "template": ...}, ...].
        found = [t.get("template") for t in template if isinstance(t, dict)]
        return [t for t in found if isinstance(t, str)]
    return []


def check_chat_template(tokenizer, where: str) -> None:
    """Refuse a tokenizer whose chat template is not valid Jinja or never reads
    ``messages`` (a copy of some other file, say); the message gives a line
    number, never the template's text.

    Args:
        tokenizer: the loaded tokenizer.
        where: the file or field the template came from, for the message.

    Raises:
        TemplateRefused: a template is not a chat template.
    """
    templates = chat_templates(tokenizer)
    for i, template in enumerate(templates):
        which = where if len(templates) == 1 else f"{where} (template {i + 1})"
        try:
            tree = _ENVIRONMENT.parse(template)
        except TemplateSyntaxError as e:
            # e.message quotes the template; the line number does not.
            raise TemplateRefused(
                f"{which} is not a valid Jinja template (at line {e.lineno})"
            ) from None
        except RecursionError:
            raise TemplateRefused(f"{which} nests too deeply") from None
        if "messages" not in meta.find_undeclared_variables(tree):
            raise TemplateRefused(
                f"{which} is not a chat template: it never reads the messages"
            )


def template_source(folder: Path) -> str:
    """Where a folder's tokenizer takes its chat template from."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (folder / name).is_file():
            return name
    return "the chat_template of tokenizer_config.json"


def _is_safetensors(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            if not 1 < length <= min(MAX_HEADER_BYTES, path.stat().st_size - 8):
                return False
            header = json.loads(file.read(length))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(header, dict)


def diagnose_folder(folder: Path, trust_remote_code: bool) -> str | None:
    """The first thing found wrong with a model folder that mlx-lm could not load,
    in words that quote none of its files; None when nothing is found."""
    try:
        config = read_json(folder / "config.json")
    except Described as e:
        return str(e)
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    if not isinstance(config.get("model_type"), str):
        return "config.json has no model_type"
    if config.get("model_file") is not None:
        if not trust_remote_code:
            return (
                "config.json asks to run model code shipped with it (model_file); "
                "the option trust_remote_code:true allows that"
            )
    else:
        try:
            _get_classes(config)
        except ValueError:
            version = metadata.version("mlx-lm")
            return f"config.json's model_type is not one that mlx-lm {version} knows"
        except Exception:  # the model's module failed to import: not the file's fault
            logger.debug("importing the model class failed", exc_info=True)
    weights = sorted(p for p in folder.glob("model*.safetensors") if p.is_file())
    if not weights:
        return "it holds no model*.safetensors weights"
    for path in weights:
        if not _is_safetensors(path):
            return f"{path.name} is not a safetensors file"
    for path in sorted(folder.glob("*.json")):
        if path.is_file():
            try:
                read_json(path)
            except Described as e:
                return str(e)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            return "chat_template.jinja is not UTF-8 text"
        except OSError as e:
            return f"chat_template.jinja can't be read ({type(e).__name__})"
    return None
