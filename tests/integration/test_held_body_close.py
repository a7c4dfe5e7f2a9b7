"""Issue 29: a request body held past limits.body_timeout_s gets its 408 and its connection closes
then, not a lingering drain later (the socket used to stay open another body_timeout_s)."""

from __future__ import annotations

import asyncio
import time

from tests.integration.test_hostile_http import running_gateway

BODY_TIMEOUT_S = 1.5


async def test_a_held_body_gets_408_and_the_socket_closes_at_once() -> None:
    async with running_gateway(**{"limits.body_timeout_s": BODY_TIMEOUT_S}) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.http_port)
        try:
            t0 = time.monotonic()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": '
            )
            await writer.drain()
            data = bytearray()
            async with asyncio.timeout(4 * BODY_TIMEOUT_S):
                while chunk := await reader.read(65536):
                    data += chunk
            closed_after = time.monotonic() - t0
        finally:
            writer.close()
        assert data.startswith(b"HTTP/1.1 408"), bytes(data[:200])
        # the 408 at BODY_TIMEOUT_S, the close with it (it came a second BODY_TIMEOUT_S later before)
        assert closed_after < BODY_TIMEOUT_S + 0.6, (
            f"the connection closed {closed_after:.2f} s after it opened"
        )
