"""Reading models: the GGUF reader, the loader (GGUF and Hugging Face folders), real-model
downloads, random GGML weights for benchmarks."""
