"""A pretrained model's tokenizer and chat template, from its GGUF file.

The book's own models read bytes (model.tokenizer). A pretrained model comes with a byte-level
BPE (GPT-2's scheme, which SmolLM2 uses): text is cut into pieces (runs of letters, a digit at a
time, runs of punctuation, whitespace), each piece's UTF-8 bytes are spelled with 256 printable
stand-in characters, and the merges, applied in rank order, join neighbouring symbols into
vocabulary entries. The `tokenizers` library (Rust) runs it; this module builds it from the
file's vocabulary and merges. The chat template is the file's jinja2 source, rendered as
transformers renders it, and generation stops at the template's end-of-turn token.
"""
from __future__ import annotations

from dataclasses import dataclass

PRE_TOKENIZERS = ("smollm", "gpt2", "default")  # the file's tokenizer.ggml.pre values this module knows
ROLES = ("system", "user", "assistant")


@dataclass
class PretrainedTokenizer:
    backend: object  # a tokenizers.Tokenizer
    specials: dict[str, int]  # control tokens (type 3 in the file) by text: <|im_start|>, <|endoftext|>, ...
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None

    @property
    def vocab(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; control tokens written in it (<|im_start|>) are read as themselves."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """The text of `ids` (an incomplete UTF-8 character at the end shows as U+FFFD)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered for `messages` ({"role": one of ROLES, "content": text}), as
        transformers' apply_chat_template renders it; with `add_generation_prompt`, ending where the
        assistant's answer begins."""
        if self.chat_template is None:
            raise ValueError("this model's file has no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or set(message) != {"role", "content"}:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content'; got {message!r}")
            if message["role"] not in ROLES:
                raise ValueError(f"message {i} has role {message['role']!r}; allowed: {', '.join(ROLES)}")
            if not isinstance(message["content"], str):
                raise ValueError(f"message {i}'s content must be a str; got {type(message['content']).__name__}")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    undefined=jinja2.StrictUndefined)
        return environment.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._text_of(self.bos_id), eos_token=self._text_of(self.eos_id))

    @property
    def end_of_turn(self) -> tuple[int, ...]:
        """Token ids that end an assistant's turn: the template's <|im_end|>, and the end of text."""
        ids = {self.specials[t] for t in ("<|im_end|>",) if t in self.specials}
        return tuple(sorted(ids | ({self.eos_id} if self.eos_id is not None else set())))

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id)


def from_gguf(tokenizer: dict, chat_template: str | None) -> PretrainedTokenizer:
    """The tokenizer that model.gguf_file.read found in a file: a byte-level BPE ("gpt2" in GGUF's
    words) with one of PRE_TOKENIZERS; anything else raises by name."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if tokenizer.get("model") != "gpt2":
        raise ValueError(f"the file's tokenizer is {tokenizer.get('model')!r}; this module builds byte-level BPE "
                         "('gpt2')")
    pre = tokenizer.get("pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"the file's pre-tokenizer is {pre!r}; this module knows {', '.join(PRE_TOKENIZERS)}")
    tokens = tokenizer["tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in tokenizer["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    splits = [pre_tokenizers.Digits(individual_digits=True)] if pre == "smollm" else []  # a digit at a time
    backend.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    control = [i for i, kind in enumerate(tokenizer.get("token_types") or []) if kind == 3]  # CONTROL
    backend.add_special_tokens([tokens[i] for i in control])
    return PretrainedTokenizer(backend, {tokens[i]: i for i in control}, tokenizer.get("bos_id"),
                               tokenizer.get("eos_id"), chat_template)
