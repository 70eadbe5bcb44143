"""How much a live stream's client may send in one frame: read by the streams' consumers
(telemetry/consumers.py) and the web server's command line (cli.py, built before Django loads: Django-free)."""

CLIENT_FRAME_MAX_CHARS = 4096  # a client sends only small control messages (a ping); a longer frame is ignored
# uvicorn buffers a whole frame before the app sees it (16 MiB by default) and closes a connection that sends
# more than this (1009, message too big). Any frame the consumers read fits: UTF-8 takes at most 4 bytes a character.
CLIENT_FRAME_MAX_BYTES = 4 * CLIENT_FRAME_MAX_CHARS
