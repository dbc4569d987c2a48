"""Render Hugging Face chat templates with jinja2, without transformers.

Chat templates shipped with tokenizers are untrusted Jinja code, so they run in
jinja2's ``ImmutableSandboxedEnvironment`` with the settings transformers uses
(``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension) and
the same extras templates rely on: ``raise_exception(msg)``,
``strftime_now(fmt)``, a ``tojson`` filter that neither escapes HTML nor ASCII,
and a ``{% generation %}`` block (rendered as plain content here; transformers
uses it to mark assistant tokens, which hybridflow computes from response
masks instead). Template variables are the same as transformers passes:
``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the special
tokens (``bos_token``, ``eos_token``, ...) and any extra keyword arguments.

Simplified on purpose: no tool-schema generation from Python functions, no
``continue_final_message`` and no control-token sanitization.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["compile_chat_template", "render_chat_template", "normalize_messages"]


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses dunder/underscore attributes.

    The sandbox already blocks reading them; refusing to store them as well
    closes the remaining route into CPython internals.
    """

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not store underscore attributes on a namespace: {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt
    # tool schemas in prompts; transformers overrides it the same way.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template; raises ``jinja2.TemplateSyntaxError`` on bad syntax."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain-dict copies of ``messages`` with ``None`` values dropped.

    Templates test ``'key' in message`` far more often than ``is none``, so a
    key carrying ``None`` (common after a parquet round trip, which fills
    missing struct fields with nulls) must look absent, as in transformers.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} must be a dict, got {type(message).__name__}: {message!r}")
        out.append({str(k): v for k, v in message.items() if v is not None})
    return out


def render_chat_template(template: jinja2.Template, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool,
                         special_tokens: Mapping[str, str],
                         **kwargs: Any) -> str:
    """Render ``messages`` with a compiled template.

    ``special_tokens`` maps names such as ``"eos_token"`` to their text; extra
    keyword arguments (e.g. ``enable_thinking=False``) are passed to the
    template and override special tokens of the same name. A template's
    ``raise_exception`` surfaces as ``jinja2.TemplateError``.
    """
    variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens, **kwargs}
    return template.render(messages=normalize_messages(messages),
                           add_generation_prompt=add_generation_prompt, **variables)
