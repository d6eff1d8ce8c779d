"""The backend with ``ForcingServicer``: the process ``Server(forcing=True)``
starts, as ``python -m tests.forcing_backend`` from the project's root."""

from backend import main
from tests.support import ForcingServicer

if __name__ == "__main__":
    main(servicer_class=ForcingServicer)
