"""The target's BPE tokenizer and ChatML template, rebuilt from GGUF metadata with `tokenizers`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from inference.gguf_source import GgufModel

TOKENIZER_FILE = "tokenizer.json"
CHAT_FORMAT_FILE = "chat_format.json"
_CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


class TokenizerError(Exception):
    """Tokenizer metadata that cannot be rebuilt, or a chat template of an unknown shape."""


def build_tokenizer(
    tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str]
) -> Tokenizer:
    """A byte-level BPE like the GGUF's `gpt2` model, digits split one by one (SmolLM's pre)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merge_pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
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


@dataclass(frozen=True)
class ChatFormat:
    """ChatML as the GGUF's template writes it: `<start>role\\ncontent<end>\\n` per message."""

    message_start: str  # "<|im_start|>"
    message_end: str  # "<|im_end|>"
    default_system: str | None  # inserted when the first message is not a system one

    @classmethod
    def from_template(cls, template: str) -> ChatFormat:
        """Read the delimiters and default system prompt out of the Jinja chat template."""
        turn = re.search(
            r"\{\{\s*'(?P<start>[^']+)'\s*\+\s*message\['role'\]\s*\+\s*'\n'\s*\+\s*"
            r"message\['content'\]\s*\+\s*'(?P<end>[^']+)'\s*\+\s*'\n'\s*\}\}",
            template,
        )
        if turn is None:
            raise TokenizerError("chat template is not ChatML-shaped")
        start, end = turn["start"], turn["end"]
        system = re.search(
            re.escape("{{ '" + start + "system\n") + r"(?P<text>[^']*)" + re.escape(end + "\n' }}"),
            template,
        )
        if f"{{{{ '{start}assistant\n' }}}}" not in template:
            raise TokenizerError("chat template has no assistant generation prompt")
        return cls(start, end, system["text"] if system else None)

    def render(self, messages: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """(role, content) turns, default system first, then an open assistant turn."""
        turns = list(messages)
        if self.default_system is not None and (not turns or turns[0][0] != "system"):
            turns.insert(0, ("system", self.default_system))
        return turns

    def to_json(self) -> dict[str, Any]:
        return {
            "message_start": self.message_start,
            "message_end": self.message_end,
            "default_system": self.default_system,
        }


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


class ChatTokenizer:
    """Encode, decode and chat-format for one model family."""

    def __init__(self, tokenizer: Tokenizer, chat_format: ChatFormat, eos_id: int) -> None:
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.eos_id = eos_id
        # Text from users must not turn into control tokens, so plain encoding ignores them.
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        start = tokenizer.token_to_id(chat_format.message_start)
        end = tokenizer.token_to_id(chat_format.message_end)
        if start is None or end is None:
            raise TokenizerError("chat delimiters are not single tokens")
        self._start_id, self._end_id = start, end

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

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
        ids: list[int] = []
        for role, content in self.chat_format.render(messages):
            ids += [self._start_id, *self.encode(f"{role}\n{content}"), self._end_id]
            ids += self.encode("\n")
        return [*ids, self._start_id, *self.encode("assistant\n")]

    def render_chat_text(self, prompt: str) -> str:
        """The same chat as text (what a Jinja renderer of the GGUF template would produce)."""
        fmt = self.chat_format
        return "".join(
            f"{fmt.message_start}{role}\n{content}{fmt.message_end}\n"
            for role, content in fmt.render([("user", prompt)])
        ) + (f"{fmt.message_start}assistant\n")

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
        chat_format = ChatFormat(
            document["message_start"], document["message_end"], document["default_system"]
        )
        return cls(tokenizer, chat_format, int(document["eos_id"]))

    @classmethod
    def from_gguf(cls, model: GgufModel) -> ChatTokenizer:
        if model.field("tokenizer.ggml.model") != "gpt2":
            raise TokenizerError("only the GGUF `gpt2` (byte-level BPE) tokenizer is supported")
        tokenizer = build_tokenizer(
            model.field("tokenizer.ggml.tokens"),
            model.field("tokenizer.ggml.token_type"),
            model.field("tokenizer.ggml.merges"),
        )
        chat_format = ChatFormat.from_template(model.field("tokenizer.chat_template"))
        return cls(tokenizer, chat_format, int(model.field("tokenizer.ggml.eos_token_id")))
