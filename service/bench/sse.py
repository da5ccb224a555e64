"""Incremental Server-Sent Events parsing: body pieces in, the data of each complete event out."""

from __future__ import annotations


class SseParser:
    """Feed body pieces as they arrive; get back the ``data`` of every event they completed.

    Lines may end with LF, CRLF (sse-starlette, used by the SDK peers) or CR, and a piece may end
    anywhere, even between the CR and the LF of one line end. Events without data (comments used as
    keep-alives, a bare ``event:`` line) yield nothing; an event cut off by the end of the stream is
    dropped, as the SSE specification says.
    """

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, piece: bytes) -> list[bytes]:
        buffer = self._buffer + piece
        if b"\r" in buffer:
            # A CR at the very end may be the first half of a CRLF: normalise it once the next piece shows.
            held = buffer.endswith(b"\r")
            if held:
                buffer = buffer[:-1]
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if held:
                buffer += b"\r"
        events: list[bytes] = []
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            data = _event_data(buffer[start:end])
            if data is not None:
                events.append(data)
            start = end + 2
        self._buffer = buffer[start:]
        return events


def _event_data(event: bytes) -> bytes | None:
    data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not data:
        return None
    return b"\n".join(data)
