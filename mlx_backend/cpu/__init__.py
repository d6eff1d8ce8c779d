"""The Linux CPU path: a fast BLAS, dequantized weights, step pacing."""
