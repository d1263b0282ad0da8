"""Tokenizers read from GGUF metadata or a Hugging Face folder: BPE (byte-level and
SentencePiece-style), SentencePiece unigram, tiktoken-style ranks, and the chat template."""

from hf2q_mlx.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
