"""One exception family for every caller error hf2q_mlx reports."""


class Hf2qError(Exception):
    """Base class: the CLI prints ``str(err)`` on one line and exits non-zero."""


class ModelNotFoundError(Hf2qError, FileNotFoundError):
    """A model path (or the default demo model package) does not exist."""


class CacheDirError(Hf2qError):
    """The model cache directory ($HF2Q_MLX_CACHE, ...) cannot be created or written."""


class GGUFFormatError(Hf2qError):
    """A GGUF file is truncated, has the wrong magic/version, or inconsistent tensor data."""


class UnsupportedArchitectureError(Hf2qError):
    """The checkpoint's architecture / model_type has no implementation here."""


class UnsupportedQuantTypeError(Hf2qError):
    """A GGML tensor type (or an MLX quantization mode) that we cannot decode."""


class CheckpointFormatError(Hf2qError):
    """A config.json, safetensors file or model setting that is malformed or out of range."""


class WeightMismatchError(Hf2qError):
    """Missing, unexpected or wrongly shaped tensors when filling a model."""


class TokenizerError(Hf2qError):
    """Tokenizer data missing or malformed."""


class ContextLengthError(Hf2qError):
    """A prompt (plus requested tokens) does not fit the model's or cache's context."""


class InvalidArgumentError(Hf2qError, ValueError):
    """A public API argument of the wrong type or outside its range (prompt, token ids, paths)."""


class NotAnEmbeddingModelError(InvalidArgumentError):
    """``embed`` was given a model without sentence-embedding modules (a text generator)."""


class PromptNameError(InvalidArgumentError):
    """An embedding task prompt that cannot apply: unknown name, or given with a prompt / ids."""


class SamplingOptionsError(InvalidArgumentError):
    """Invalid generation / sampling options (temperature < 0, top_p outside (0, 1], ...)."""


class QueueFullError(Hf2qError):
    """The server's request queue is full (HTTP 429): retry later."""


class DraftModelError(InvalidArgumentError):
    """A speculative-decoding draft model that does not share the target's vocabulary."""
