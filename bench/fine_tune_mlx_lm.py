"""Part 15's mlx-lm side: ``mlx_lm lora`` run as its command line runs it, with a
training callback that writes each report as a JSON line to the file named first
(``python -m bench.fine_tune_mlx_lm REPORTS -- <mlx_lm lora arguments>``).

mlx-lm's ``run`` builds its callback from ``--report-to`` and drops any other, so
the callback goes in through ``get_reporting_callbacks``.
"""

import json
import sys

import mlx_lm.lora
from mlx_lm.tuner.callbacks import TrainingCallback

from mlx_backend.training.worker import peak_rss_bytes


class Recorder(TrainingCallback):
    def __init__(self, path: str):
        self._out = open(path, "w", buffering=1)

    def on_train_loss_report(self, info: dict) -> None:
        rss = peak_rss_bytes() / 1e9
        self._out.write(json.dumps({**info, "peak_rss_gb": rss}) + "\n")


def main(argv: list[str]) -> None:
    reports, rest = argv[0], argv[argv.index("--") + 1 :]
    recorder = Recorder(reports)
    mlx_lm.lora.get_reporting_callbacks = lambda *args, **kwargs: recorder
    sys.argv = ["mlx_lm.lora", *rest]
    mlx_lm.lora.main()


if __name__ == "__main__":
    main(sys.argv[1:])
