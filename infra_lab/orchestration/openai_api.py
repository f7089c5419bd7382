"""The OpenAI API's request bodies, checked, and its responses, shaped (completions and chat).

`parse` turns a JSON body into the engine's SamplingParams and prompt tokens, or raises ApiError
with OpenAI's error object: the message names the bad value and what is allowed, `param` names
the field. Parameters are OpenAI's (`max_tokens`, `temperature`, `top_p`, `n`, `stop`, `seed`,
`logprobs`, `top_logprobs`, `stream_options.include_usage`) with vLLM's `top_k`, `min_tokens` and
`ignore_eos`. A prompt past the context is refused as vLLM words it, with both lengths.
"""
from __future__ import annotations

import itertools
import json
import secrets
import time
from dataclasses import dataclass

from infra_lab.serving.request import MAX_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions; a chat's default is what the context leaves
ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """An HTTP error with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Parsed:
    chat: bool
    model: str
    prompt: list[int]  # token ids
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives listed beside each token (None: no log-probabilities)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _number(body: dict, name: str, default, low: float, high: float, whole: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _bad(name, f"must be {'a whole number' if whole else 'a number'}; got {value!r}")
    if not low <= value <= high:
        raise _bad(name, f"must be in [{low}, {high}]; got {value!r}")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"must be a non-empty string or a list of them; got {body['stop']!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} strings; got {len(stop)}")
    return tuple(stop)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"must be a non-empty list of {{role, content}} objects; got {messages!r}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _bad(f"messages[{i}]", f"needs a role, one of {', '.join(ROLES)}; got {message!r}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content", "parts must be {'type': 'text', 'text': str}; this model "
                                                     "reads text only")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"must be a string; got {content!r}")
        out.append({"role": message["role"], "content": content})
    return out


def _prompt(body: dict, served) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = served.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = served.model.config.vocab
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise _bad("prompt", f"token {bad[0]} is outside the vocabulary [0, {vocab})")
        tokens = list(prompt)
    else:
        raise _bad("prompt", f"must be a string, or a list of token ids (one prompt per request); got {prompt!r}")
    if not tokens:
        raise _bad("prompt", "is empty; a request needs at least one token")
    return tokens


def parse(body, served, chat: bool, max_n: int) -> Parsed:
    """The request in `body` (decoded JSON) for `served` (served.Served), or ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object; got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", f"must be a string naming the model; got {model!r}")
    if model != served.name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{served.name}`",
                       param="model", code="model_not_found")
    prompt = served.encode(served.chat(_messages(body))) if chat else _prompt(body, served)
    context = served.context
    name = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    default = max(context - len(prompt), 1) if chat else COMPLETION_MAX_TOKENS
    max_tokens = _number(body, name, default, 1, 10**9, whole=True)
    if len(prompt) + max_tokens > context:
        where = "messages" if chat else "prompt"
        raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the {where}, {max_tokens} in the "
                            f"completion). Please reduce the length of the {where} or completion.",
                       param=where, code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise _bad("top_p", "must be > 0 (1 keeps every token)")
    top_k = _number(body, "top_k", 0, -1, served.model.config.vocab, whole=True)
    n = _number(body, "n", 1, 1, max_n, whole=True)
    seed = _number(body, "seed", None, 0, 2**63 - 1, whole=True)
    min_tokens = _number(body, "min_tokens", 0, 0, max_tokens, whole=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"must be true or false; got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad("stream_options", f"must be {{'include_usage': bool}}; got {body.get('stream_options')!r}")
    if options and not stream:
        raise _bad("stream_options", "is only allowed when stream is true")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", f"must be true or false; got {ignore_eos!r}")
    logprobs = _logprobs(body, chat)
    stops = () if ignore_eos else (served.end_of_turn if chat else served.end_of_text)
    params = SamplingParams(temperature=float(temperature), top_k=max(int(top_k), 0), top_p=float(top_p),
                            seed=secrets.randbits(31) if seed is None else int(seed), max_tokens=int(max_tokens),
                            stop_tokens=tuple(stops), n=int(n), logprobs=logprobs, stop=_stop(body),
                            min_tokens=int(min_tokens))
    return Parsed(chat, model, prompt, params, stream, bool(options.get("include_usage", False)), logprobs)


def _logprobs(body: dict, chat: bool) -> int | None:
    if not chat:
        return _number(body, "logprobs", None, 0, MAX_LOGPROBS, whole=True)
    wanted = body.get("logprobs", False)
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad("logprobs", f"must be true or false in a chat request; got {wanted!r}")
    top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, whole=True)
    if top is not None and not wanted:
        raise _bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


# ---- responses ------------------------------------------------------------------------------------

def fingerprint(versions) -> str:
    """system_fingerprint: the weight versions the tokens came from, e.g. 'infra-lab-w3' or 'infra-lab-w3-w4'."""
    return "infra-lab-" + "-".join(f"w{v}" for v in sorted(set(versions)))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def envelope(request_id: str, parsed: Parsed, versions, chunk: bool) -> dict:
    kind = ("chat.completion" if parsed.chat else "text_completion") + (".chunk" if chunk and parsed.chat else "")
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": parsed.model,
            "system_fingerprint": fingerprint(versions)}


def logprob_entries(parsed: Parsed, served, tokens: list[int], logprobs: list[float], tops: list) -> dict:
    """One choice's `logprobs` object for these tokens: chat's `content` list, or completions' four lists."""
    texts = [served.token_text(t) for t in tokens]
    if parsed.chat:
        def entry(text, value):
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        return {"content": [entry(text, value) | {"top_logprobs": [entry(served.token_text(t), v) for t, v in top]}
                            for text, value, top in zip(texts, logprobs, tops)]}
    return {"tokens": texts, "token_logprobs": logprobs,
            "top_logprobs": [{served.token_text(t): v for t, v in top} for top in tops],
            "text_offset": [0, *itertools.accumulate(len(text) for text in texts)][:-1]}


async def json_body(request):
    """A request's body as decoded JSON (a Starlette Request), or ApiError 400."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the body is not valid JSON: {error}") from None
