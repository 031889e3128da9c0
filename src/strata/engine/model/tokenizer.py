"""Text to token ids and back: a checkpoint's `tokenizer.json` read with `tokenizers`, its chat
template rendered with jinja2, and an incremental detokenizer for streaming.

Also writes the byte-level tokenizer of the random checkpoints `strata init-model` makes: the
256 bytes are ids 0-255 (no merges, so any text round-trips), then a few specials (`<|endoftext|>`
256, `<|im_start|>` 257, `<|im_end|>` 258, `<|pad|>` 259) and a ChatML chat template.

A model's vocabulary can be larger than its tokenizer's: the random checkpoints of the big presets
keep the real vocabulary size (for realistic speed) while their tokenizer knows 260 ids, and real
checkpoints pad their embeddings too. `Tokenizer.decode` turns every id the tokenizer does not
know into U+FFFD (the replacement character) instead of dropping it or failing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from strata.engine.model.presets import BYTE_TOKENS, SPECIAL_TOKENS
from strata.formats.jsonfile import json_repr, json_type, read_json_object

REPLACEMENT_CHAR = "\ufffd"

# ChatML, as the Qwen and OLMoE instruct checkpoints use; every turn ends with <|im_end|>.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be read or used: one line saying what was wrong."""


def _token_text(config_file: Path, config: dict[str, Any], name: str) -> str | None:
    """`bos_token` and friends: a string, null, or an AddedToken object with a string
    `content`, in tokenizer_config.json; TokenizerError naming the field otherwise."""
    value = config.get(name)
    content = value.get("content") if isinstance(value, dict) else value
    if content is not None and not isinstance(content, str):
        raise TokenizerError(f"{config_file}: {name} must be a string, null, or an object with "
                             f"a string 'content', got {json_repr(value)} ({json_type(value)})")
    return content


def _named_template(config_file: Path, templates: list[Any]) -> str | None:
    """The "default" of named templates: [{"name": "default", "template": ...}, ...]."""
    for item in templates:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)):
            raise TokenizerError(f"{config_file}: chat_template must be a string or a list of "
                                 "objects with a string 'name' and 'template', got an item "
                                 f"{json_repr(item)}")
    return next((item["template"] for item in templates if item["name"] == "default"), None)


def _read_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    config_file = model_dir / "tokenizer_config.json"
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        template = _named_template(config_file, template)
    elif template is not None and not isinstance(template, str):
        raise TokenizerError(f"{config_file}: chat_template must be a string, a list of named "
                             f"templates or null, got {json_type(template)}")
    if isinstance(template, str):
        return template
    # Newer checkpoints keep the template in a file of its own.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise TokenizerError(f"{jinja_file} cannot be read as UTF-8 text: {err}") from None
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        document = read_json_object(json_file, what="chat_template.json", error=TokenizerError)
        template = document.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{json_file}: chat_template must be a string, got "
                                 f"{json_type(template)}")
        return template
    return None


def _raise_template_exception(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, chat template, streaming detokenizer."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read `tokenizer.json` (required) and `tokenizer_config.json` (optional) in `path`."""
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{tokenizer_file} not found: strata reads the tokenizer from a tokenizer.json "
                f"(the fast-tokenizer file) beside config.json"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the Rust error says what it could not parse
            raise TokenizerError(f"{tokenizer_file} could not be read: {err}") from None
        config: dict[str, Any] = {}
        config_file = model_dir / "tokenizer_config.json"
        if config_file.exists() or config_file.is_symlink():  # a broken link is an error too
            config = read_json_object(config_file, what="tokenizer_config.json",
                                      error=TokenizerError)
        return cls(
            backend,
            bos_token=_token_text(config_file, config, "bos_token"),
            eos_token=_token_text(config_file, config, "eos_token"),
            chat_template=_read_chat_template(model_dir, config),
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's own post-processor
        (e.g. Mixtral's leading `<s>`). Special-token text in `text` becomes its id.
        TokenizerError for text that is not Unicode (a lone surrogate, as undecodable bytes of
        a command line become)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise TokenizerError(f"the text holds {text[err.start]!r} at character {err.start}, "
                                 "which is not Unicode (bytes that are not UTF-8?)") from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an id the tokenizer does not know becomes U+FFFD."""
        pieces: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if 0 <= token_id < self.vocab_size:
                run.append(int(token_id))
                continue
            if run:
                pieces.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            pieces.append(REPLACEMENT_CHAR)
        if run:
            pieces.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(pieces)

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render the chat template (jinja2, sandboxed, as transformers renders it)."""
        if self.chat_template is None:
            raise TokenizerError(
                "this checkpoint has no chat template (none in tokenizer_config.json, "
                "chat_template.jinja or chat_template.json); run without --chat"
            )
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as err:
            raise TokenizerError(f"chat template could not be rendered: {err}") from None

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of the rendered chat, ready for the assistant's reply. The template writes
        any BOS itself, so the tokenizer's post-processor is not applied again."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def detokenizer(self, context_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A streaming detokenizer; `context_ids` (the prompt's last few ids) let the first
        generated token decode with the spacing it has after the prompt."""
        return IncrementalDetokenizer(self, context_ids)


class IncrementalDetokenizer:
    """Turns generated ids into text as they come, holding back incomplete characters.

    A token can end in the middle of a UTF-8 character (byte-level vocabularies), and a
    SentencePiece token's leading space depends on what precedes it. So each step decodes a
    short window of ids, from `prefix_offset`, and emits what it adds to the text already
    emitted, unless that ends in U+FFFD from a valid id, which means an incomplete character:
    then it waits for the next id. `flush` emits what is still held.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = [int(i) for i in context_ids]
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(self.ids)  # ids before this one have been emitted

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", never held twice)."""
        self.ids.append(int(token_id))
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        incomplete = new_text.endswith(REPLACEMENT_CHAR) and (
            0 <= token_id < self.tokenizer.vocab_size
        )
        if len(new_text) <= len(prefix_text) or incomplete:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text of ids still held back (incomplete characters come out as U+FFFD)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character, as `tokenizers`'
    ByteLevel pre-tokenizer and decoder expect."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes, strict=True)}


def byte_level_tokenizer_json() -> str:
    """tokenizer.json of the random checkpoints: byte i is id i, then SPECIAL_TOKENS."""
    alphabet = _bytes_to_unicode()
    added = [
        {
            "id": BYTE_TOKENS + index,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for index, token in enumerate(SPECIAL_TOKENS)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {alphabet[byte]: byte for byte in range(256)},
            "merges": [],
        },
    }
    return json.dumps(document, ensure_ascii=False, indent=2) + "\n"


def byte_level_tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json of the random checkpoints, in transformers' format."""
    return {
        "added_tokens_decoder": {
            str(BYTE_TOKENS + index): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for index, token in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
