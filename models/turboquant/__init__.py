"""TurboQuant KV cache in one place: the codec (rotation + scalar codebooks), the state its
kernels read, the kernel dispatch with its MLX references, and the packed caches with their
attention call."""
