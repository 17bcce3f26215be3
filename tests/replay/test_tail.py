"""``replay tail`` fails politely and reads a hostile stream safely: a path is
a usage error (exit 2, no traceback), nothing listening says so and how to
check, messages of another shape are skipped and counted, and a part larger
than a frame is refused by the socket itself (``zmq.MAXMSGSIZE``)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from offload_fsm.log.framing import Record, frame, scan
from offload_fsm.log.records import PUB_TOPIC, encode_digest
from replay import tail
from tests.replay.conftest import run_cli

GOLDEN = Path(__file__).parent.parent / "data" / "logs" / "v6"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _frames() -> tuple[bytes, bytes]:
    """A header frame (a recorded log's) and a digest frame after it."""
    data = (GOLDEN / "golden-000000.lolog").read_bytes()[:1 << 16]
    header = next(item for item in scan(data) if isinstance(item, Record))
    return frame(header.payload), frame(encode_digest(7, 0, "0123456789abcdef"))


def test_a_path_is_a_usage_error_without_a_traceback() -> None:
    code, out, err = run_cli("tail", str(GOLDEN))
    assert code == 2 and out == ""
    assert "is a file or directory, not an endpoint" in err and "Traceback" not in err
    code, _, err = run_cli("tail", "localhost:5600")
    assert code == 2 and "expected an endpoint such as tcp://127.0.0.1:5600" in err
    code, _, err = run_cli("tail", "tcp://localhost")
    assert code == 2 and "expected tcp://HOST:PORT" in err


def test_nothing_listening_says_so_and_how_to_check() -> None:
    port = _free_port()
    code, out, err = run_cli("tail", f"tcp://127.0.0.1:{port}", "--timeout", "0.5")
    assert code == 1
    assert f"nothing is listening at tcp://127.0.0.1:{port} (yet); still trying" in out
    assert f"ss -ltn 'sport = :{port}'" in out
    assert "no record arrived; nothing listened at the endpoint" in err


def _tail_against(publish: Callable[[Any, list[str]], None], records: int
                  ) -> tuple[tail.TailResult, list[str]]:
    """Run :func:`tail.follow` against a PUB socket that ``publish`` drives
    (it sees the lines printed so far) until ``records`` records printed."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    lines: list[str] = []
    results: list[tail.TailResult] = []
    thread = threading.Thread(target=lambda: results.append(tail.follow(
        endpoint, lines.append, max_records=records, timeout_s=10.0)))
    thread.start()
    try:
        publish(pub, lines)
        thread.join(15)
    finally:
        pub.close(linger=0)
        context.term()
    assert not thread.is_alive() and results, lines
    return results[0], lines


def _until_printed(pub: Any, lines: list[str], message: list[bytes], text: str) -> None:
    """Send ``message`` again and again until a printed line holds ``text``."""
    deadline = time.monotonic() + 10
    while not any(text in line for line in lines) and time.monotonic() < deadline:
        pub.send_multipart(message)
        time.sleep(0.02)


def test_messages_of_another_shape_are_skipped_and_counted() -> None:
    header, second = _frames()

    def publish(pub: Any, lines: list[str]) -> None:
        _until_printed(pub, lines, [PUB_TOPIC, header], "header schema")  # subscribed now
        pub.send_multipart([PUB_TOPIC, second, b"a third part"])
        pub.send_multipart([PUB_TOPIC])
        pub.send_multipart([PUB_TOPIC + b"-not-ours", second])
        _until_printed(pub, lines, [PUB_TOPIC, second], "seq ")

    result, lines = _tail_against(publish, records=2)
    assert result.records == 2 and result.malformed == 3, lines
    assert lines[-1].startswith("skipped 3 malformed message(s)")


def test_a_part_larger_than_a_frame_is_refused_by_the_socket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """libzmq drops the connection of a sender whose part exceeds
    ``MAXMSGSIZE`` before allocating it: the message never reaches ``tail``
    (which would count it as malformed), and tail reconnects."""
    monkeypatch.setattr(tail, "MAX_MESSAGE_BYTES", 4096)
    header, second = _frames()
    assert len(second) < 4096

    def publish(pub: Any, lines: list[str]) -> None:
        _until_printed(pub, lines, [PUB_TOPIC, header], "header schema")
        pub.send_multipart([PUB_TOPIC, b"x" * 100_000])
        _until_printed(pub, lines, [PUB_TOPIC, second], "seq ")

    result, lines = _tail_against(publish, records=2)
    assert result.records == 2 and result.malformed == 0, lines
    assert any("dropped (the server stopped, or sent a message part over 4096 bytes); "
               "reconnecting" in line for line in lines), lines
