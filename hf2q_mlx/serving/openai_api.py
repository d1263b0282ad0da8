"""OpenAI request parsing and response bodies (chat completions and completions), no web framework.

``parse_chat`` / ``parse_completion`` turn a decoded JSON body into prompt token ids and
``SamplingParams``, raising InvalidArgumentError with ``param`` / ``code`` attributes for the 400
body. The ``*_chunk`` and ``*_response`` functions build the JSON objects the endpoints send.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

from hf2q_mlx.errors import Hf2qError, InvalidArgumentError, SamplingOptionsError
from hf2q_mlx.generation import encode_prompt, is_int
from hf2q_mlx.serving.batch_sampler import SamplingParams
from hf2q_mlx.serving.engine import Event

# OpenAI fields that change the output and are not implemented: refused rather than ignored
UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "suffix")
PARAMS = {f for f in SamplingParams.__dataclass_fields__} | {
    "max_completion_tokens",
    "model",
    "messages",
    "prompt",
    "n",
    "stream",
}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> Hf2qError:
    err = InvalidArgumentError(message)
    err.param, err.code = param, code  # type: ignore[attr-defined]
    return err


def error_body(err: Exception, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object for ``err``; the param is guessed from a SamplingOptionsError's
    first word (they all start with the option's name)."""
    message = " ".join(str(err).split())
    param = getattr(err, "param", None)
    if param is None and isinstance(err, SamplingOptionsError):
        first = message.split(" ", 1)[0]
        param = first if first in PARAMS else None
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": getattr(err, "code", None)}}  # fmt: skip


MAX_CHOICES = 128  # OpenAI's bound on ``n``


@dataclass
class ParsedRequest:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    n: int = 1  # choices: one engine request each, choice i seeded seed + i

    def choice_params(self) -> list[SamplingParams]:
        """Each choice's sampling: the request's, the seed (where given) moved by the index so
        the choices differ yet repeat."""
        seed = self.params.seed
        return [
            self.params if seed is None else replace(self.params, seed=(seed + i) % 2**63)
            for i in range(self.n)
        ]


def _number(body: dict, name: str, default: float, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = (
        is_int(value)
        if integer
        else isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )
    if not ok:
        kind = "an integer" if integer else "a number"
        raise bad_request(f"{name} must be {kind}, got {value!r}", name, "invalid_type")
    return value


def model_of(body: dict, model_ids: set[str]) -> str:
    """The request's ``model``, one of ``model_ids`` (else the 400 error)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model must be a non-empty string", "model", "invalid_type")
    if model not in model_ids:
        raise bad_request(
            f"model {model!r} is not served here; available: {', '.join(sorted(model_ids))}",
            "model",
            "model_not_found",
        )
    return model


def _common(body: dict, model_ids: set[str], max_len: int, top_logprobs: int, logprobs: bool):
    model = model_of(body, model_ids)
    for name in UNSUPPORTED:
        if body.get(name):
            raise bad_request(f"{name} is not supported by this server", name, "unsupported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request(
            "response_format: only {\"type\": \"text\"} is supported by this server",
            "response_format", "unsupported",
        )  # fmt: skip
    if _number(body, "repetition_penalty", 1.0) != 1.0:
        raise bad_request(
            "repetition_penalty is not supported by this server (use presence_penalty / "
            "frequency_penalty)", "repetition_penalty", "unsupported",
        )  # fmt: skip
    n = _number(body, "n", 1, integer=True)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be an integer in [1, {MAX_CHOICES}], got {n}", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise bad_request(f"{name} must be an integer >= 1, got {max_tokens!r}", name)
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise bad_request(f"seed must be an integer, got {seed!r}", "seed")
    params = SamplingParams(
        max_tokens=max_len if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_k=_number(body, "top_k", 0, integer=True),
        top_p=_number(body, "top_p", 1.0),
        min_p=_number(body, "min_p", 0.0),
        seed=None if seed is None else seed % 2**63,
        stop=stops,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        ignore_eos=bool(body.get("ignore_eos", False)),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )
    params.validate()
    return params, stream, bool(options.get("include_usage", False)), model, n


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias`` ({"token id": bias}, JSON keys are strings) -> {id: bias}; the
    ranges are checked by ``SamplingParams.validate`` and the vocabulary by the engine."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object of token ids to numbers", "logit_bias")
    out = {}
    for key, bias in value.items():
        text = key.strip() if isinstance(key, str) else ""
        if not (text.isascii() and text.isdigit()):  # int() refuses '²', a digit too
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(text)] = bias
    return out


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported", "messages"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or text parts", "messages")


def parse_chat(body: Any, tokenizer: Any, model_ids: set[str], max_len: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a role", "messages")
        rendered.append({"role": m["role"], "content": _message_text(i, m.get("content"))})
    logprobs = body.get("logprobs", False) or False
    if not isinstance(logprobs, bool):
        raise bad_request(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
    top = _number(body, "top_logprobs", 0, integer=True)
    if top and not logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    common = _common(body, model_ids, max_len, top, logprobs)
    try:
        ids = encode_prompt(tokenizer, rendered)
    except InvalidArgumentError as err:
        raise bad_request(str(err), "messages") from None
    return ParsedRequest(ids, *common)


def parse_completion(body: Any, tokenizer: Any, model_ids: set[str], max_len: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str) and prompt:
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise bad_request(
            "prompt must be a non-empty string or list of token ids (one prompt per request)",
            "prompt",
        )
    if body.get("echo"):
        raise bad_request("echo is not supported by this server", "echo", "unsupported")
    if _number(body, "best_of", 1, integer=True) != 1:
        raise bad_request("best_of must be 1", "best_of", "unsupported")
    n = body.get("logprobs")
    if n is not None and (not is_int(n) or not 0 <= n <= 5):
        raise bad_request(f"logprobs must be an integer in [0, 5], got {n!r}", "logprobs")
    return ParsedRequest(ids, *_common(body, model_ids, max_len, n or 0, n is not None))


# ---- responses ---------------------------------------------------------------------------------


def _token_text(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Any, events: list[Event]) -> dict[str, Any]:
    content = []
    for e in events:
        if e.token is None or e.logprob is None:
            continue
        text, raw = _token_text(tokenizer, e.token)
        tops = []
        for t, lp in e.top_logprobs:
            tt, tb = _token_text(tokenizer, t)
            tops.append({"token": tt, "logprob": lp, "bytes": tb})
        content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(tokenizer: Any, events: list[Event], offset: int = 0) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    for e in events:
        if e.token is None or e.logprob is None:
            continue
        text, _ = _token_text(tokenizer, e.token)
        tokens.append(text)
        lps.append(e.logprob)
        tops.append({_token_text(tokenizer, t)[0]: lp for t, lp in e.top_logprobs})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(lasts: list[Event]) -> dict[str, Any]:
    """The request's usage from each choice's last event: the prompt counted once (its cached
    tokens are the first choice's; the others reuse that choice's prompt), completions summed."""
    prompt = lasts[0].prompt_tokens
    completion = sum(e.completion_tokens for e in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": lasts[0].cached_tokens},
    }


def chat_response(
    rid: str, model: str, tokenizer: Any, choices: list[list[Event]], lp: bool
) -> dict:
    """The non-streaming body; ``choices``: each choice's events, in index order."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(e.text for e in events)},
                "logprobs": chat_logprobs(tokenizer, events) if lp else None,
                "finish_reason": events[-1].finish_reason,
            }
            for i, events in enumerate(choices)
        ],
        "usage": usage([events[-1] for events in choices]),
    }


def completion_response(
    rid: str, model: str, tokenizer: Any, choices: list[list[Event]], lp: bool
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": "".join(e.text for e in events),
                "logprobs": completion_logprobs(tokenizer, events) if lp else None,
                "finish_reason": events[-1].finish_reason,
            }
            for i, events in enumerate(choices)
        ],
        "usage": usage([events[-1] for events in choices]),
    }


def chat_chunk(
    rid: str, model: str, delta: dict, finish: str | None, logprobs=None, index: int = 0
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        ],
    }


def completion_chunk(
    rid: str, model: str, text: str, finish: str | None, logprobs=None, index: int = 0
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }


def usage_chunk(rid: str, model: str, obj: str, lasts: list[Event]) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": usage(lasts)}  # fmt: skip
