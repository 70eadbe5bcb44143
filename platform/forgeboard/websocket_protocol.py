"""The web server's websocket protocol: uvicorn's (websockets' sans-I/O implementation), which also answers a
handshake that websockets' parser refuses.

websockets reads a handshake's request line and each header line up to 8 KiB. Past that its parser rejects the
request (414 URI too long, 431 header fields too large) and queues the answer, but uvicorn 0.54's protocol writes a
connection's output only for the events it handles, and a refused handshake has none: the answer was never sent and
the connection stayed open, the client waiting for ever. Loaded by `uvicorn --ws` (cli.py): Django-free.
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class WebSocketProtocol(WebSocketsSansIOProtocol):
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.handshake_initiated and self.conn.handshake_exc is not None:
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.transport.close()
