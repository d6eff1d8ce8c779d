"""The suite for ``python -m unittest test.py``, as LocalAI's test.sh runs it.

One test runs the whole pytest suite (pyproject.toml: tests/ and test_mlx_cache.py)
in a subprocess from the project root, in xdist workers (tests/conftest.py), with
jemalloc and the fast BLAS preloaded the way backend.py's restart does it; pytest's
output streams through, and the test fails when pytest does. ``make test`` and
./test.sh run it.

PYTEST_ADDOPTS, pytest's own variable, adds options, e.g. one layer or a few tests:
``PYTEST_ADDOPTS="-m unit" python -m unittest test.py`` or
``PYTEST_ADDOPTS="-k grammar -x" ./test.sh``.
"""

import os
import subprocess
import sys
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PYTEST = [sys.executable, "-m", "pytest", "-v"]


def suite_environment(environ) -> dict:
    """``environ`` with jemalloc and the fast BLAS preloaded on Linux CPU (unchanged
    elsewhere): MLX binds its BLAS when it loads, so pytest has to start with them."""
    from mlx_backend.cpu.preload import preloaded_environment

    return preloaded_environment(environ)


class TestSuite(unittest.TestCase):
    def test_pytest_suite(self):
        sys.stdout.flush()
        sys.stderr.flush()
        status = subprocess.run(
            PYTEST, cwd=ROOT, env=suite_environment(os.environ)
        ).returncode
        self.assertEqual(status, 0, f"pytest exited with status {status}")


if __name__ == "__main__":
    unittest.main()
