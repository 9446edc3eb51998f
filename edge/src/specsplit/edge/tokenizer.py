"""The draft export's tokenizer and chat template, with the `tokenizers` library and jinja2."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from specsplit.common.fingerprint import vocab_fingerprint


# How the error begins where the chat template fails on one prompt (not on every one).
TEMPLATE_FAILED = "the chat template failed on this prompt"


def _raise(message: str) -> None:
    """The template's own refusal of a prompt (`raise_exception`)."""
    raise ValueError(f"{TEMPLATE_FAILED}: {message}")


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """As transformers renders `tojson` in chat templates (jinja2's own escapes HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates use to mark
    the assistant's part for training masks: rendering, it is its content."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox that renders chat templates as transformers does: its options, extensions,
    filter and functions."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


class EdgeTokenizer:
    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not directory.is_dir():
            what = "is not a directory" if directory.exists() else "does not exist"
            raise FileNotFoundError(f"{directory} {what} (a draft export directory: specsplit-server export-draft)")
        if not path.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a bad file
            raise ValueError(f"{path} is not a tokenizer the tokenizers library can read ({exc})") from None
        config_path = directory / "tokenizer_config.json"
        try:
            self._config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{config_path} is not valid JSON ({exc})") from None
        if not isinstance(self._config, dict):
            raise ValueError(f"{config_path} holds no settings object: export the draft again")
        template_path = directory / "chat_template.jinja"
        source = template_path if template_path.is_file() else config_path
        self.chat_template: str | None = (
            template_path.read_text(encoding="utf-8") if template_path.is_file()
            else _default_template(self._config.get("chat_template"))
        )
        # The template's special tokens (bos_token, eos_token, ...), as transformers passes them.
        self._special = {k: v for k, v in self._config.items() if k.endswith("_token") and isinstance(v, str)}
        self._template: Template | str | None = None  # the compiled template, or why it does not parse
        if self.chat_template:
            try:  # compiled once; a broken one matters only to chat prompts, not to raw ones
                self._template = chat_environment().from_string(self.chat_template)
            except Exception as exc:  # Jinja raises more than TemplateError for some malformed sources
                self._template = f"the chat template in {source} does not parse ({exc})"
        self.fingerprint = vocab_fingerprint(self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. A rendered chat template holds its special tokens already;
        a raw prompt gets the ones the tokenizer adds (a BOS, for many models), as
        transformers' tokenizer(text) gives them."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def chat_prompt(self, user_text: str) -> str:
        """The text of a one-turn chat, rendered with the model's own template."""
        if self._template is None:
            raise ValueError("this model has no chat template: send the prompt as it is (specsplit-edge: --raw)")
        if isinstance(self._template, str):
            raise ValueError(self._template)
        try:
            # tools and documents as transformers passes them where there are none: a template's
            # "tools is not none" is true of an undefined one.
            return self._template.render(messages=[{"role": "user", "content": user_text}], tools=None,
                                         documents=None, add_generation_prompt=True, **self._special)
        except TemplateError as exc:  # raise_exception's ValueError, which says so itself, passes as it is
            raise ValueError(f"{TEMPLATE_FAILED} ({exc})") from None


def _default_template(template: object) -> str | None:
    """A tokenizer config's chat template: a string, or (as transformers also writes them)
    a list of named templates, of which a one-turn chat takes the one named "default"."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
