#!/usr/bin/env python3
"""Export a GGUF model as an MLX-format folder (for mlx_lm.load or mlx_lm.server).

Usage: python -m mlx_backend.models.export [--dequantize] [MODEL.gguf | default] OUTPUT_FOLDER
"""

import argparse
import logging

from mlx_backend.models.gguf import export_mlx_folder
from mlx_backend.models.loading import default_model_path

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "gguf", help="a .gguf file, or 'default' for the embedded model"
    )
    parser.add_argument("output", help="the MLX folder to write")
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="write float32 weights, as the fast Linux CPU path runs them",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    source = default_model_path() if args.gguf == "default" else args.gguf
    folder = export_mlx_folder(source, args.output, dequantize=args.dequantize)
    logger.info("exported %s to %s", source, folder)


if __name__ == "__main__":
    main()
