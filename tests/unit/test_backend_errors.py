"""backend.py's error mapping: an exception the servicer does not expect ends the
call as INTERNAL, with its type and message, on a fake gRPC context."""

import grpc
import pytest


def test_internal_errors_map_to_internal():
    import asyncio

    from backend import _abort

    class Context:
        async def abort(self, code, details):
            raise RuntimeError((code, details))

    with pytest.raises(RuntimeError) as info:
        asyncio.run(_abort(Context(), ZeroDivisionError("boom")))
    assert info.value.args[0] == (grpc.StatusCode.INTERNAL, "ZeroDivisionError: boom")
