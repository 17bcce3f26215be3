"""The SIGTERM forwarder (``connector.shell.shutdown_signal``), in a child process
shaped like vLLM's idle engine core: the main thread waits on a queue with
no timeout, and the SIGTERM handler wakes it through a helper thread (as
vLLM's ``SignalCallback`` does). A signal sent to another thread by
``tgkill`` must still reach the handler; a signal sent to the main thread
must be heard once and not forwarded, and a forward is not forwarded
again; a forked child's signal stays the child's; another owner's wakeup fd
stays.
The e2e test with a real engine: ``tests/e2e/test_shutdown_signal.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import logging, os, queue, signal, sys, threading
    from connector.shell import shutdown_signal
    from testkit.engine import signal_thread

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    target, other_owner = sys.argv[1], sys.argv[2] == "1"
    if other_owner:
        theirs, _ = __import__("socket").socketpair()
        theirs.setblocking(False)
        signal.set_wakeup_fd(theirs.fileno())
    inbox, wake, heard = queue.Queue(), threading.Event(), []

    def engine_handler(signum, frame):  # vLLM's: a flag, and a one-shot wakeup
        heard.append(signum)
        wake.set()

    if target != "application":  # vLLM's engine core's handler, as install() knows it
        engine_handler.__module__ = shutdown_signal.VLLM_ENGINE_CORE
    signal.signal(signal.SIGTERM, engine_handler)
    threading.Thread(target=lambda: (wake.wait(), inbox.put("wakeup")), daemon=True).start()
    ours = []
    print("installed", shutdown_signal.install(lambda: ours.append(1)), flush=True)
    if other_owner:
        print("wakeup fd kept", signal.set_wakeup_fd(theirs.fileno()) == theirs.fileno(),
              flush=True)
    parked, parked_tid = threading.Event(), []

    def park():
        parked_tid.append(threading.get_native_id())
        parked.wait()

    def send():
        while not parked_tid:
            pass
        tid = os.getpid() if target == "main" else parked_tid[0]
        signal_thread(os.getpid(), tid, int(signal.SIGTERM))

    if target == "application":  # an embedding application's handler: left alone
        print("handler kept", signal.getsignal(signal.SIGTERM) is engine_handler, flush=True)
        sys.exit(0)
    if target == "twice":  # two signals during one C call: one handler run, two bytes
        import hashlib

        def twice():
            threading.Event().wait(0.2)
            signal_thread(os.getpid(), os.getpid(), int(signal.SIGTERM))
            threading.Event().wait(0.05)
            signal_thread(os.getpid(), os.getpid(), int(signal.SIGTERM))

        threading.Thread(target=twice, daemon=True).start()
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 3_000_000)  # ~1 s in one C call
        inbox.get()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # vLLM tearing down
        # (a forward while the C call ran, before the handler could, is right)
        threading.Event().wait(1.0)  # a forward now would kill this process
        print("survived", len(heard), flush=True)
        sys.exit(0)
    if target == "forked child":  # the child's own signal is not the parent's
        child = os.fork()
        if child == 0:
            signal.raise_signal(signal.SIGTERM)
            os._exit(0)
        os.waitpid(child, 0)
        try:
            inbox.get(timeout=1.0)
        except queue.Empty:
            print("not woken", len(heard), flush=True)
        sys.exit(0)
    threading.Thread(target=park, daemon=True).start()
    threading.Timer(0.3, send).start()
    inbox.get()  # idle, no timeout: only the handler wakes it
    threading.Event().wait(1.0)  # a forward of our own forward would come in this time
    print("woke", len(heard), len(ours), flush=True)
""")


def _child(target: str, other_owner: bool = False) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-c", _CHILD, target, "1" if other_owner else "0"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the child's idle main thread never heard SIGTERM to {target}: "
                    f"{error.stderr!r}")


def test_a_signal_that_lands_on_another_thread_wakes_the_idle_main_thread() -> None:
    done = _child("other")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["installed True", "woke 1 1"]
    assert "did not hear a signal; sent it to the main thread signal=SIGTERM" in done.stderr


def test_a_signal_the_main_thread_gets_is_heard_once_and_not_forwarded() -> None:
    done = _child("main")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["installed True", "woke 1 1"]
    assert "did not hear" not in done.stderr


def test_a_forked_childs_signal_is_not_sent_to_the_parent() -> None:
    done = _child("forked child")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["installed True", "not woken 0"]
    assert "did not hear" not in done.stderr


def test_another_owners_wakeup_fd_is_left_alone() -> None:
    # Nothing forwards then: the signal to the main thread is still heard.
    done = _child("main", other_owner=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["installed True", "wakeup fd kept True", "woke 1 1"]


def test_an_applications_own_signal_handler_is_left_alone() -> None:
    """An application embedding an in-process engine keeps its SIGTERM
    handler: only vLLM's engine core's is chained."""
    done = _child("application")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["installed False", "handler kept True"]


def test_two_signals_heard_as_one_are_not_forwarded_after_the_default_is_back() -> None:
    """CPython runs its handler once for two signals that came during one C
    call, leaving a byte unmatched; vLLM then restores SIG_DFL while it tears
    down. A forward of that byte would kill the engine mid-teardown."""
    done = _child("twice")
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split("\n")[:2] == ["installed True", "survived 1"]
