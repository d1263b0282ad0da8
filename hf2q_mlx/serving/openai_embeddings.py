"""OpenAI's embeddings request and response (``/v1/embeddings``), no web framework: ``input`` as
a string, a list of strings, a list of token ids or a list of such lists; ``encoding_format``
"float" or "base64" (little-endian float32, what the ``openai`` client asks for by default);
``dimensions`` (Matryoshka truncation, then L2 normalization). ``prompt_name`` (ours: a task
prompt of the model's sentence-transformers config, e.g. "query" or "document") picks the text
prepended to string inputs.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from hf2q_mlx.embedding import check_embedding_ids, embedding_token_ids
from hf2q_mlx.errors import InvalidArgumentError, PromptNameError
from hf2q_mlx.generation import is_int
from hf2q_mlx.serving.openai_api import bad_request, model_of

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


@dataclass
class ParsedEmbeddings:
    ids: list[list[int]]  # one token id list per input, as the model runs it
    model: str
    dimensions: int | None
    encoding_format: str  # "float" or "base64"


def _inputs(value: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """``input`` as (texts, None) or (None, token id lists); raises the 400 error."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a non-empty string or list", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input has {len(value)} items; at most {MAX_INPUTS}", "input")
    if all(isinstance(v, str) for v in value):
        for i, v in enumerate(value):
            if not v:
                raise bad_request(f"input[{i}] is an empty string", "input")
        return value, None
    if all(is_int(v) for v in value):
        return None, [list(value)]
    if all(isinstance(v, list) and v and all(is_int(t) for t in v) for v in value):
        return None, [list(v) for v in value]
    raise bad_request(
        "input must be a string, a list of strings, a list of token ids or a list of "
        "non-empty lists of token ids",
        "input",
    )


def parse_embeddings(
    body: Any, model_ids: set[str], model: Any, tokenizer: Any, dims: int
) -> ParsedEmbeddings:
    """The request for ``model`` (an embedding model of ``dims`` outputs) as token ids."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    name = model_of(body, model_ids)
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ("float", "base64"):
        raise bad_request(
            f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (not is_int(dimensions) or not 1 <= dimensions <= dims):
        raise bad_request(
            f"dimensions must be an integer in [1, {dims}], got {dimensions!r}", "dimensions"
        )
    prompt_name = body.get("prompt_name")
    if prompt_name is not None and not isinstance(prompt_name, str):
        raise bad_request("prompt_name must be a string", "prompt_name")
    texts, ids = _inputs(body.get("input"))
    try:
        if texts is not None:
            ids = embedding_token_ids(
                model, tokenizer, texts, prompt_name=prompt_name, what="input"
            )
        else:
            if prompt_name is not None:
                raise PromptNameError("prompt_name applies to text input, not token ids")
            check_embedding_ids(model, ids, "input")
    except PromptNameError as err:
        raise bad_request(str(err), "prompt_name") from None
    except InvalidArgumentError as err:
        raise bad_request(str(err), "input") from None
    return ParsedEmbeddings(ids, name, dimensions, fmt)


def embeddings_response(parsed: ParsedEmbeddings, vectors: np.ndarray) -> dict[str, Any]:
    """The response body for ``vectors`` (N, D) float32, one per input in order."""

    def encode(v: np.ndarray) -> list[float] | str:
        if parsed.encoding_format == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.tolist()

    tokens = sum(len(r) for r in parsed.ids)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                 for i, v in enumerate(vectors)],
        "model": parsed.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }  # fmt: skip
