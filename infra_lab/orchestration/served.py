"""The model a server serves, with what HTTP needs around it: text in and out, a chat template,
token strings for log-probabilities, and the engine that runs it.

The book's own models read and write bytes: a token is one byte, and a chat is rendered with the
book's stated template (`BYTE_CHAT_TEMPLATE`), since they were trained on Python source and never
on dialogue. A pretrained model (SmolLM2) brings its byte-level BPE and its own chat template,
and a chat's answer ends at the template's end-of-turn token.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BYTE_CHAT_TEMPLATE = "{role}: {content}\n"  # each message; the answer follows "assistant: "
BOOK_MODELS = ("target", "draft")


@dataclass
class Served:
    name: str  # what clients ask for
    model: object  # a Transformer
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    token_text: Callable[[int], str]  # one token as text, for log-probabilities
    chat: Callable[[list[dict]], str]  # messages -> the prompt text, ending where the answer begins
    end_of_text: tuple[int, ...]  # tokens that end a completion (unless ignore_eos)
    end_of_turn: tuple[int, ...]  # tokens that end a chat answer
    byte_tokens: bool  # a token is one byte (the book's models)
    about: str

    @property
    def context(self) -> int:
        return self.model.config.context

    def detokenizer(self) -> "TextStream":
        return TextStream(self)


class TextStream:
    """Output text as tokens come: each `add` returns the text the new tokens completed (a
    character cut across tokens waits for its last byte)."""

    def __init__(self, served: Served):
        self.served, self.tokens, self.sent = served, [], 0
        self._bytes = codecs.getincrementaldecoder("utf-8")("replace") if served.byte_tokens else None

    def add(self, tokens: list[int]) -> str:
        if self._bytes is not None:
            return self._bytes.decode(bytes(tokens))
        self.tokens.extend(tokens)
        text = self.served.decode(self.tokens)
        if text.endswith("\ufffd"):  # a character still being spelled
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new

    def finish(self) -> str:
        if self._bytes is not None:
            return self._bytes.decode(b"", final=True)
        text = self.served.decode(self.tokens)
        new, self.sent = text[self.sent:], len(text)
        return new


def _byte_chat(messages: list[dict]) -> str:
    return "".join(BYTE_CHAT_TEMPLATE.format(**m) for m in messages) + "assistant: "


def _byte_token_text(token: int) -> str:
    return chr(token) if token < 128 else f"bytes:\\x{token:02x}"  # vLLM's spelling of a partial character


def load(model: str, name: str | None = None, version: int = 0) -> Served:
    """The book's models by name (BOOK_MODELS), a pretrained one by name, or a file: a .npz of the
    book's format, or a llama .gguf; its weights start as `version`. Raises by name when none of
    these fits."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"a weight version is a whole number >= 0; got {version!r}")
    from infra_lab.model import pretrained, weights as weight_files
    from infra_lab.model.transformer import Transformer

    if model in BOOK_MODELS or (model.endswith(".npz") and Path(model).is_file()):
        path = weight_files.path_for(model) if model in BOOK_MODELS else Path(model)
        state, config, figures = weight_files.load(path)
        return Served(name or model, Transformer(config, state, figures, version),
                      encode=lambda text: list(text.encode("utf-8")),
                      decode=lambda ids: bytes(ids).decode("utf-8", errors="replace"),
                      token_text=_byte_token_text, chat=_byte_chat, end_of_text=(), end_of_turn=(),
                      byte_tokens=True, about=f"the book's {config.name} model ({path.name}), byte tokens")
    if model in pretrained.MODELS or model.endswith(".gguf"):
        transformer, tokenizer = pretrained.load(model)
        transformer.version = version
        return Served(name or model, transformer, encode=tokenizer.encode,
                      decode=lambda ids: tokenizer.decode(ids, skip_special=True),
                      token_text=lambda token: tokenizer.decode([token]),
                      chat=lambda messages: tokenizer.chat(messages),
                      end_of_text=() if tokenizer.eos_id is None else (tokenizer.eos_id,),
                      end_of_turn=tokenizer.end_of_turn, byte_tokens=False,
                      about=pretrained.MODELS[model].about if model in pretrained.MODELS else f"the file {model}")
    raise ValueError(f"no model {model!r}: serve one of {', '.join(BOOK_MODELS + tuple(pretrained.MODELS))}, "
                     "or a weights file (.npz of the book's format, or a llama .gguf)")
