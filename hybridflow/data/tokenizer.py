"""One tokenizer interface over Hugging Face fast tokenizers and SentencePiece.

hybridflow needs a handful of things from a tokenizer: ids for prompts, text
for responses, the EOS/PAD/BOS ids, and the chat template. transformers
provides all of that but is a heavy, fast-moving dependency, so this module
reads the same files directly:

* ``tokenizer.json`` (plus ``tokenizer_config.json``, ``special_tokens_map.json``
  and ``chat_template.jinja`` when present) through the ``tokenizers`` library;
* ``tokenizer.model`` or a single ``*.model`` file through ``sentencepiece``.

Behaviour follows transformers 5 where it matters for RL: ``pad_token_id``
falls back to ``eos_token_id`` (as verl does); with a ``tokenizer.json`` its
post-processor alone decides which BOS/EOS ``encode`` adds (``add_bos_token``
/ ``add_eos_token`` in the config are ignored there, as transformers ignores
them), while for SentencePiece they apply, BOS on by default (Llama
convention); chat templates render exactly as
``apply_chat_template(..., tokenize=False)``.

Simplified on purpose: special tokens named in the config but absent from the
vocabulary are ignored with a warning instead of being appended (that would
change the vocabulary size behind the model's back), and the SentencePiece
backend cannot hold added tokens beyond the model's own pieces.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import sentencepiece
import tokenizers
from tokenizers import processors

from hybridflow.data.chat_template import compile_chat_template, render_chat_template
from hybridflow.data.prompts import render_prompt

__all__ = ["Tokenizer", "build_char_tokenizer"]

logger = logging.getLogger("hybridflow.data")

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_MAP_FILE = "special_tokens_map.json"
_TEMPLATE_FILE = "chat_template.jinja"
_HF_FILE = "tokenizer.json"
_SP_FILE = "tokenizer.model"

# transformers' legacy "clean_up_tokenization_spaces" rewrites, applied in order.
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


@dataclass
class _Settings:
    """What the JSON files beside the vocabulary say about the tokenizer."""

    special: dict[str, str] = field(default_factory=dict)  # "eos_token" -> "</s>"
    chat_template: str | None = None
    add_bos_token: bool | None = None  # None: the config does not say
    add_eos_token: bool | None = None
    clean_up_tokenization_spaces: bool = False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, where: str) -> str | None:
    # Configs store special tokens either as plain strings or as serialized
    # AddedToken dicts ({"content": "</s>", "lstrip": false, ...}).
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: special token must be a string or a dict with 'content', got {value!r}")


def _pick_template(value: Any, where: str) -> str | None:
    # A config may hold several named templates; the "default" one is used.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"]
        logger.warning("%s: chat templates %s have none named 'default'; ignoring them",
                       where, sorted(map(str, named)))
        return None
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates")


def _load_settings(directory: Path) -> _Settings:
    settings = _Settings()
    config_path = directory / _CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    map_path = directory / _SPECIAL_MAP_FILE
    special_map = _read_json(map_path) if map_path.is_file() else {}
    for name in _SPECIAL_NAMES:
        # tokenizer_config.json wins: modern checkpoints keep the authoritative
        # values there and special_tokens_map.json only for old readers.
        text = _token_text(config.get(name), f"{config_path}:{name}")
        if text is None:
            text = _token_text(special_map.get(name), f"{map_path}:{name}")
        if text is not None:
            settings.special[name] = text
    template_path = directory / _TEMPLATE_FILE
    if template_path.is_file():
        settings.chat_template = template_path.read_text(encoding="utf-8")
    else:
        settings.chat_template = _pick_template(config.get("chat_template"), str(config_path))
    if settings.chat_template:  # a syntax error is the file's, found at load rather than at the first prompt
        try:
            compile_chat_template(settings.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            where = template_path if template_path.is_file() else config_path
            raise ValueError(f"{where}: the chat template does not compile: {exc.message} (template line "
                             f"{exc.lineno})") from None
    for flag in ("add_bos_token", "add_eos_token"):
        if flag in config and config[flag] is not None:
            setattr(settings, flag, bool(config[flag]))
    settings.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
    return settings


class _HFBackend:
    """``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self.tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _SPBackend:
    """A SentencePiece model.

    SentencePiece never produces control pieces (``<s>``, ``</s>``) from text,
    yet chat templates write them as text, so the text is first split on the
    special pieces; each piece of ordinary text between them is encoded on its
    own (transformers' "legacy" behaviour for Llama-style tokenizers).
    """

    def __init__(self, sp: sentencepiece.SentencePieceProcessor, extra_specials: Iterable[str]) -> None:
        self.sp = sp
        self.vocab_size = sp.get_piece_size()
        self.special_ids = frozenset(
            i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i))
        texts = {sp.id_to_piece(i) for i in self.special_ids}
        texts |= {t for t in extra_specials if self.token_to_id(t) is not None}
        texts.discard("")
        self.special_ids |= {self.token_to_id(t) for t in texts}
        ordered = sorted(texts, key=len, reverse=True)  # longest first: "<|im_end|>" before "<|im"
        self._split_re = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None
        self.bos_id: int | None = None  # set by Tokenizer: ids added by encode(add_special_tokens=True)
        self.eos_id: int | None = None

    def token_to_id(self, token: str) -> int | None:
        token_id = self.sp.piece_to_id(token)
        # piece_to_id answers unk_id for unknown pieces; only an exact round trip counts.
        return token_id if self.sp.id_to_piece(token_id) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None

    def _encode_one(self, text: str, add_special_tokens: bool) -> list[int]:
        parts = self._split_re.split(text) if self._split_re is not None else [text]
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:  # odd parts are the captured special tokens
                ids.append(self.token_to_id(part))
            elif part:
                ids.extend(self.sp.encode(part))
        if add_special_tokens:
            ids = ([self.bos_id] if self.bos_id is not None else []) + ids
            ids += [self.eos_id] if self.eos_id is not None else []
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        return [self._encode_one(t, add_special_tokens) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self.special_ids])
        out: list[str] = []
        run: list[int] = []
        for i in ids + [-1]:  # -1 flushes the last run
            if i >= 0 and i not in self.special_ids:
                run.append(i)
                continue
            if run:
                # Each run drops its leading word-boundary space, mirroring encode,
                # which gives every text segment its own dummy prefix.
                out.append(self.sp.decode(run))
                run = []
            if i >= 0:
                out.append(self.sp.id_to_piece(i))
        return "".join(out)


def _find_vocab_file(path: Path) -> Path:
    """The file that defines the vocabulary at ``path`` (a directory or a file)."""
    if path.is_file():
        if path.suffix in (".json", ".model"):
            return path
        raise ValueError(f"{path}: expected a tokenizer.json or a SentencePiece *.model file")
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer path {path} does not exist (expected a directory holding "
            f"{_HF_FILE} or {_SP_FILE}, or the path of such a file)")
    for name in (_HF_FILE, _SP_FILE):
        if (path / name).is_file():
            return path / name
    models = sorted(path.glob("*.model"))
    if len(models) == 1:
        return models[0]
    found = f"; found several *.model files: {[m.name for m in models]}" if models else ""
    raise FileNotFoundError(
        f"no tokenizer in {path}: looked for {_HF_FILE}, {_SP_FILE} or a single *.model file{found}")


def _as_id_list(ids: Any) -> list[int]:
    # Accept tensors and numpy arrays (rollout hands those over) as well as lists.
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class Tokenizer:
    """Encode/decode, special ids and chat template for one vocabulary.

    Build with :meth:`from_path`. ``vocab_size`` is one more than the largest
    id (the embedding rows a model needs), added tokens included.
    """

    def __init__(self, backend: _HFBackend | _SPBackend, settings: _Settings, name_or_path: str) -> None:
        self._backend = backend
        self._settings = settings
        self.name_or_path = name_or_path
        self._special_ids: dict[str, int] = {}
        for name, text in list(settings.special.items()):
            token_id = backend.token_to_id(text)
            if token_id is None:
                logger.warning("%s: %s %r is not in the vocabulary; ignoring it", name_or_path, name, text)
                del settings.special[name]
            else:
                self._special_ids[name] = token_id
        self._template: Any = None  # compiled lazily; jinja templates do not pickle

    @classmethod
    def from_path(cls, path: str | Path) -> "Tokenizer":
        """Load from a directory (or a ``tokenizer.json`` / ``*.model`` file).

        ``tokenizer.json`` is preferred over SentencePiece when a directory
        holds both, as transformers' fast tokenizers do. Config files are read
        from the same directory as the vocabulary file.
        """
        vocab_file = _find_vocab_file(Path(path))
        settings = _load_settings(vocab_file.parent)
        if vocab_file.suffix == ".json":
            try:
                hf_tok = tokenizers.Tokenizer.from_file(str(vocab_file))
            except Exception as exc:  # tokenizers raises bare Exception on malformed files
                raise ValueError(f"{vocab_file}: not a valid tokenizer.json ({exc})") from exc
            backend: _HFBackend | _SPBackend = _HFBackend(hf_tok)
        else:
            backend = cls._sp_backend(vocab_file, settings)
        tok = cls(backend, settings, str(path))
        if isinstance(backend, _SPBackend):
            # Llama convention: a SentencePiece tokenizer adds BOS unless told not to.
            add_bos = settings.add_bos_token if settings.add_bos_token is not None else True
            backend.bos_id = tok.bos_token_id if add_bos else None
            backend.eos_id = tok.eos_token_id if settings.add_eos_token else None
        return tok

    @staticmethod
    def _sp_backend(vocab_file: Path, settings: _Settings) -> _SPBackend:
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.load(str(vocab_file))
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"{vocab_file}: not a SentencePiece model ({exc})") from exc
        # Names the config leaves out come from the model's own special ids.
        for name, token_id in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                               ("pad_token", sp.pad_id()), ("unk_token", sp.unk_id())):
            if name not in settings.special and token_id >= 0:
                settings.special[name] = sp.id_to_piece(token_id)
        return _SPBackend(sp, settings.special.values())

    # -- encoding -----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS per the tokenizer's rules."""
        return self._backend.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel for ``tokenizer.json``)."""
        return self._backend.encode_batch(texts, add_special_tokens)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list, tensor or array of ints)."""
        text = self._backend.decode(_as_id_list(ids), skip_special_tokens)
        if self._settings.clean_up_tokenization_spaces:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def batch_decode(self, sequences: Iterable[Any], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` for each sequence (rows of a 2-D tensor work too)."""
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id, or None."""
        return self._backend.id_to_token(token_id)

    # -- special tokens -----------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def bos_token(self) -> str | None:
        return self._settings.special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._settings.special.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        """The pad token text; the EOS text when the tokenizer defines no pad."""
        return self._settings.special.get("pad_token", self.eos_token)

    @property
    def unk_token(self) -> str | None:
        return self._settings.special.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_ids.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_ids.get("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The pad id; falls back to ``eos_token_id`` when there is no pad token (as verl does)."""
        return self._special_ids.get("pad_token", self.eos_token_id)

    @property
    def unk_token_id(self) -> int | None:
        return self._special_ids.get("unk_token")

    # -- chat ---------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._settings.chat_template

    @property
    def has_chat_template(self) -> bool:
        return bool(self._settings.chat_template)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the chat template, as transformers'
        ``apply_chat_template(..., tokenize=False)`` does.

        Extra keyword arguments are template variables. Raises ``ValueError``
        when there is no template and ``jinja2.TemplateError`` when the
        template itself raises.
        """
        if not self.has_chat_template:
            raise ValueError(f"tokenizer {self.name_or_path} has no chat template")
        if self._template is None:
            self._template = compile_chat_template(self._settings.chat_template)
        return render_chat_template(self._template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=dict(self._settings.special), **kwargs)

    def render_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text for ``messages``: :func:`hybridflow.data.prompts.render_prompt` through the chat
        template when there is one, else the messages' contents joined by newlines."""
        return render_prompt(self, messages, chat=self.has_chat_template)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_template"] = None
        return state

    def __repr__(self) -> str:
        kind = "sentencepiece" if isinstance(self._backend, _SPBackend) else "tokenizers"
        return (f"Tokenizer({self.name_or_path!r}, backend={kind}, vocab_size={self.vocab_size}, "
                f"eos={self.eos_token!r}, pad={self.pad_token!r}, chat_template={self.has_chat_template})")


def build_char_tokenizer(chars: str, out_dir: str | Path, eos: str = "<eos>", pad: str = "<pad>",
                         bos: str = "<bos>", unk: str = "<unk>", add_bos_token: bool = False) -> Path:
    """Write a character-level ``tokenizer.json`` + ``tokenizer_config.json`` to ``out_dir``.

    Ids: ``pad``=0, ``bos``=1, ``eos``=2, ``unk``=3, then each distinct
    character of ``chars`` in order; any other character encodes as ``unk``.
    Every character (whitespace included) is its own token and decoding
    concatenates tokens, so ``decode(encode(s)) == s`` for text over ``chars``.
    The files load with :meth:`Tokenizer.from_path` and with transformers.
    Returns ``out_dir``.
    """
    specials = [pad, bos, eos, unk]
    if len(set(specials)) != len(specials) or not all(specials):
        raise ValueError(f"special tokens must be distinct and non-empty, got {specials}")
    alphabet = list(dict.fromkeys(chars))
    if not alphabet:
        raise ValueError("chars must contain at least one character")
    clash = set(alphabet) & set(specials)
    if clash:
        raise ValueError(f"characters {sorted(clash)} are also special tokens")
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=unk))
    # "[\s\S]" rather than "." so that newlines are split off too.
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in specials])
    if add_bos_token:  # tokenizer.json's post-processor is what decides BOS for every reader
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / _HF_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": pad, "unk_token": unk, "add_bos_token": add_bos_token, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}
    (out / _CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
