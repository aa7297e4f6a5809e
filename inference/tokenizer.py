"""A target's BPE tokenizer and chat template, rebuilt from GGUF metadata with `tokenizers`.

The chat template is the GGUF's own Jinja template, rendered in jinja2's immutable sandbox (a
template is data from whoever made the GGUF: it may not reach Python objects or mutate ours).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from inference.model_config import LlamaConfig

if TYPE_CHECKING:
    from jinja2 import Template

TOKENIZER_FILE = "tokenizer.json"
CHAT_FORMAT_FILE = "chat_format.json"
_CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL

# The split before byte-level BPE, by the GGUF's `tokenizer.ggml.pre`. Llama 3's and Qwen2's
# patterns are those their tokenizers publish; SmolLM's is GPT-2's with digits split one by one.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = ("smollm", "gpt2", "default", "llama-bpe", "llama3", "qwen2")


class TokenizerError(Exception):
    """Tokenizer metadata that cannot be rebuilt, or a chat template that cannot be rendered."""


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    if pre in ("llama-bpe", "llama3", "qwen2"):
        pattern = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise TokenizerError(
        f"pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
    )


def build_tokenizer(
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[str],
    pre: str = "smollm",
) -> Tokenizer:
    """A byte-level BPE like the GGUF's `gpt2` model, split first as `pre` says."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merge_pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tokens[index], special=True, normalized=False)
        for index, kind in enumerate(token_types)
        if kind == _CONTROL_TOKEN_TYPE
    ]
    tokenizer.add_special_tokens(specials)
    for token in specials:
        if vocab[token.content] != tokenizer.token_to_id(token.content):
            raise TokenizerError(f"special token {token.content!r} moved off its GGUF id")
    return tokenizer


def vocab_sha256(tokenizer: Tokenizer) -> str:
    """The identity of a vocabulary: every id's token, the merges and which tokens are special.

    Two models that agree on it read and write the same ids for the same text, whatever the
    `tokenizers` version that serialised their files; a draft must share its target's.
    """
    return document_vocab_sha256(json.loads(tokenizer.to_str()))


def document_vocab_sha256(document: dict[str, Any]) -> str:
    """`vocab_sha256` of a tokenizer.json document as read from disk (no `Tokenizer` built)."""
    merges = [m if isinstance(m, str) else " ".join(m) for m in document["model"]["merges"]]
    vocab = sorted(document["model"]["vocab"].items(), key=lambda item: item[1])
    added = sorted((t["id"], t["content"], bool(t["special"])) for t in document["added_tokens"])
    canonical = json.dumps(
        {"vocab": vocab, "merges": merges, "added": added},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _raise_exception(message: str) -> NoReturn:
    raise TokenizerError(f"chat template refused the conversation: {message}")


def compile_chat_template(source: str) -> Template:
    """The template in jinja2's immutable sandbox, as chat templates expect to be rendered."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.globals["raise_exception"] = _raise_exception
    try:
        return environment.from_string(source)
    except TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


def chatml_template(message_start: str, message_end: str, default_system: str | None) -> str:
    """The ChatML template of files written before templates were kept whole (SmolLM2's shape)."""
    turn = (
        "{{ '"
        + message_start
        + "' + message['role'] + '\\n' + message['content'] + '"
        + message_end
        + "' + '\\n' }}"
    )
    system = ""
    if default_system is not None:
        system = (
            "{% if loop.first and messages[0]['role'] != 'system' %}{{ '"
            + message_start
            + "system\\n"
            + default_system
            + message_end
            + "\\n' }}{% endif %}"
        )
    return (
        "{% for message in messages %}" + system + turn + "{% endfor %}"
        "{% if add_generation_prompt %}{{ '" + message_start + "assistant\\n' }}{% endif %}"
    )


@dataclass(frozen=True)
class ChatFormat:
    """The GGUF's Jinja chat template and the special tokens it may name."""

    template: str
    bos_token: str = ""
    eos_token: str = ""

    @cached_property
    def compiled(self) -> Template:
        return compile_chat_template(self.template)

    def render(
        self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the template writes it, with an open assistant turn."""
        from jinja2 import TemplateError

        try:
            return str(
                self.compiled.render(
                    messages=[{"role": role, "content": content} for role, content in messages],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                )
            )
        except TemplateError as exc:
            raise TokenizerError(f"chat template failed to render: {exc}") from exc

    def to_json(self) -> dict[str, Any]:
        return {"template": self.template, "bos_token": self.bos_token, "eos_token": self.eos_token}

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> ChatFormat:
        if "template" in document:
            return cls(document["template"], document["bos_token"], document["eos_token"])
        template = chatml_template(
            document["message_start"], document["message_end"], document["default_system"]
        )
        return cls(template, "", "")


class IncrementalDetokenizer:
    """Text of a growing id sequence, emitted only once its bytes form whole characters."""

    def __init__(self, tokenizer: ChatTokenizer, prefix_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prefix_ids)
        # Decoding from a few tokens back keeps leading-space handling right at the seam.
        self._prefix_offset = len(self._ids)
        self._read_offset = len(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        """Append ids; return the newly completed text (may be "" mid-character)."""
        self._ids.extend(ids)
        before = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is left (an incomplete character comes out as U+FFFD)."""
        before = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._tokenizer.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return after[len(before) :]


class GgufFields(Protocol):
    """What `ChatTokenizer.from_gguf` reads of a GGUF (modelbuild.gguf_source.GgufModel)."""

    @property
    def config(self) -> LlamaConfig: ...

    def field(self, key: str) -> Any: ...

    def has_field(self, key: str) -> bool: ...


class ChatTokenizer:
    """Encode, decode and chat-format for one model family."""

    def __init__(self, tokenizer: Tokenizer, chat_format: ChatFormat, eos_id: int) -> None:
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.eos_id = eos_id
        # Text from users must not turn into control tokens, so plain encoding ignores them.
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._specials = [t.content for t in tokenizer.get_added_tokens_decoder().values()]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @cached_property
    def vocab_sha256(self) -> str:
        return vocab_sha256(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Ids of plain text; control-token spellings inside it stay ordinary text."""
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, prompt: str, system: str | None = None) -> list[int]:
        """Ids of a one-user-turn chat, ending with the open assistant header."""
        messages = [("system", system)] if system is not None else []
        return self.encode_chat([*messages, ("user", prompt)])

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Ids of the rendered template: its own control tokens count, the messages' never do.

        Where no message spells a control token, this is the rendered text encoded whole, as
        the model was trained. Otherwise each message is encoded as plain text between the
        template's pieces, so a user cannot forge a turn.
        """
        if not any(special in content for _, content in messages for special in self._specials):
            rendered = self.chat_format.render(messages)
            return list(self.tokenizer.encode(rendered, add_special_tokens=False).ids)
        marks = [f"\ue000{index}\ue001" for index in range(len(messages))]
        marked = self.chat_format.render(
            [(role, mark) for (role, _), mark in zip(messages, marks, strict=True)]
        )
        contents = {mark: content for mark, (_, content) in zip(marks, messages, strict=True)}
        expected = self.chat_format.render(messages)
        if _fill(marked, contents.__getitem__) != expected:
            raise TokenizerError(
                "a message spells a control token and the chat template rewrites message text"
            )
        ids: list[int] = []
        for piece in re.split("(\ue000\\d+\ue001)", marked):
            if piece in contents:
                ids += self.encode(contents[piece])
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False).ids
        return ids

    def render_chat_text(self, prompt: str) -> str:
        """The chat of one user turn as text, the way the GGUF's template renders it."""
        return self.chat_format.render([("user", prompt)])

    def detokenizer(self, prefix_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prefix_ids)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / TOKENIZER_FILE))
        document = {**self.chat_format.to_json(), "eos_id": self.eos_id}
        (directory / CHAT_FORMAT_FILE).write_text(json.dumps(document, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> ChatTokenizer:
        """From the files `save` wrote (tokenizer.json and chat_format.json)."""
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        document = json.loads((directory / CHAT_FORMAT_FILE).read_text())
        return cls(tokenizer, ChatFormat.from_json(document), int(document["eos_id"]))

    @classmethod
    def from_gguf(cls, model: GgufFields) -> ChatTokenizer:
        kind = model.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"tokenizer model {kind!r} is not supported; only byte-level BPE (gpt2) is"
            )
        if not model.has_field("tokenizer.chat_template"):
            raise TokenizerError("the GGUF has no tokenizer.chat_template")
        pre = (
            str(model.field("tokenizer.ggml.pre"))
            if model.has_field("tokenizer.ggml.pre")
            else "gpt2"
        )
        tokens: list[str] = model.field("tokenizer.ggml.tokens")
        tokenizer = build_tokenizer(
            tokens,
            model.field("tokenizer.ggml.token_type"),
            model.field("tokenizer.ggml.merges"),
            pre,
        )
        config = model.config
        bos = tokens[config.bos_id] if model.has_field("tokenizer.ggml.bos_token_id") else ""
        chat_format = ChatFormat(
            str(model.field("tokenizer.chat_template")), bos, tokens[config.eos_id]
        )
        chat_format.compiled  # noqa: B018  (a template that does not compile fails the build)
        return cls(tokenizer, chat_format, config.eos_id)


def _fill(marked: str, content: Callable[[str], str]) -> str:
    return re.sub("\ue000\\d+\ue001", lambda match: content(match.group(0)), marked)
