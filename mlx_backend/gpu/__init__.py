"""What the backend sets up for MLX's GPU backends (CUDA), and the device in words."""

import mlx.core as mx


def on_cuda() -> bool:
    """Whether MLX evaluates on a CUDA GPU by default."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def device_description() -> str:
    """The default device: "CPU", or the GPU's name and MLX backend."""
    if mx.default_device() != mx.gpu:
        return "CPU"
    backend = "CUDA" if mx.cuda.is_available() else "Metal"
    name = mx.device_info().get("device_name") or "GPU"
    return f"GPU {name} ({backend})"
