"""hf2q_mlx: GGUF and Hugging Face LLMs on MLX with custom GPU kernels."""

__version__ = "0.1.0"
