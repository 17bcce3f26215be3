"""Start and stop a real ``lmcache server`` (LMCache 0.5.6 multi-process server) for tests.

The server runs as a subprocess on free loopback ports; its output goes to a log file (never
a pipe, which could fill up and block the server).  Readiness is detected by polling the HTTP
``/healthcheck`` endpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """Return a currently unused TCP port on ``host``, below the kernel's ephemeral range.

    A port from the ephemeral range can be taken, once its server is killed, by a client that
    keeps reconnecting to it: the kernel may give the client's socket that very port as its
    source and the connection meets itself (a TCP self-connect), so a restart on the same port
    finds it in use.  Ports below the range are never handed out as sources.
    """
    low, _ = _ephemeral_range()
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    for port in candidates[:200]:
        if _ports_free(host, (port,)):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ports_free(host: str, ports: tuple[int, ...]) -> bool:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _lmcache_executable() -> str:
    candidate = Path(sys.executable).parent / "lmcache"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("lmcache")
    if found is None:
        raise FileNotFoundError("the `lmcache` console script was not found next to python")
    return found


class LMCacheServer:
    """A real LMCache MP server subprocess; usable as a context manager.

    Attributes after :meth:`start`: ``host`` (``127.0.0.1``), ``port`` (ZMQ request port),
    ``http_port`` (HTTP admin API), ``log_path`` (combined stdout/stderr log).
    """

    STARTUP_TIMEOUT_S = 60.0

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        chunk_size: int = 256,
        l1_size_gb: float = 1,
        eviction_policy: str = "LRU",
        transfer_mode: str = "auto",
        log_dir: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.host = host
        self.chunk_size = chunk_size
        self.l1_size_gb = l1_size_gb
        self.eviction_policy = eviction_policy
        self.transfer_mode = transfer_mode
        self.extra_args = list(extra_args or [])
        self.startup_timeout_s = startup_timeout_s
        self._owns_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.log_path: Path | None = None
        self.port = 0
        self.http_port = 0
        self.prometheus_port = 0
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self.paused = False

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        return [
            _lmcache_executable(),
            "server",
            "--host", self.host,
            "--port", str(self.port),
            "--http-host", self.host,
            "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", str(self.l1_size_gb),
            "--eviction-policy", self.eviction_policy,
            "--supported-transfer-mode", self.transfer_mode,
            *self.extra_args,
        ]  # fmt: skip

    def start(self, *, same_ports: bool = False) -> LMCacheServer:
        """Spawn the server and wait until ``/healthcheck`` answers.

        ``same_ports``: reuse the ports of the previous run (a restart after
        :meth:`kill`, so a connected vLLM finds the server where it was).
        """
        if self._proc is not None:
            raise RuntimeError("server already started")
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="lmcache-server-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / "lmcache-server.log"
        if not (same_ports and self.port):
            self.port = free_port(self.host)
            self.http_port = free_port(self.host)
            self.prometheus_port = free_port(self.host)
            while len({self.port, self.http_port, self.prometheus_port}) < 3:
                self.http_port = free_port(self.host)
                self.prometheus_port = free_port(self.host)
        env = {**os.environ, **QUIET_ENV}
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        last_err: Exception | None = None
        while time.monotonic() < deadline:
            rc = self._proc.poll()
            if rc is not None:
                raise RuntimeError(
                    f"lmcache server exited with rc={rc} before becoming ready; "
                    f"log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self._url("/healthcheck"), timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last_err = exc
            time.sleep(0.25)
        raise TimeoutError(
            f"lmcache server not healthy after {self.startup_timeout_s:.0f}s "
            f"(last error: {last_err!r}); log tail:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            if self.paused:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on TERM
                self.paused = False
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # ------------------------------------------------------------------ faults
    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("server not started")
        return self._proc.pid

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the server (no cleanup, no goodbye to its clients) and reap it.

        The ports are kept, so :meth:`restart` brings it back where clients expect it.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            raise RuntimeError("server not started")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout_s)
        self.paused = False
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def pause(self) -> None:
        """SIGSTOP the server: its sockets stay open but nothing answers (a hang)."""
        if self._proc is None:
            raise RuntimeError("server not started")
        self._proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT a :meth:`pause`d server."""
        if self._proc is None:
            raise RuntimeError("server not started")
        self._proc.send_signal(signal.SIGCONT)
        self.paused = False

    def restart(self) -> LMCacheServer:
        """Start again on the same ports (after :meth:`kill` or :meth:`stop`).

        Waits up to ``startup_timeout_s`` for a killed server's ports to be free.
        """
        if self._proc is not None:
            self.stop()
        deadline = time.monotonic() + self.startup_timeout_s
        ports = (self.port, self.http_port, self.prometheus_port)
        while busy := [port for port in ports if not _ports_free(self.host, (port,))]:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ports {busy} of {ports} (zmq/http/prometheus) still in use "
                    f"{self.startup_timeout_s:.0f}s after the server stopped"
                )
            time.sleep(0.2)
        return self.start(same_ports=True)

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ queries
    def _url(self, path: str) -> str:
        return f"http://{self.host}:{self.http_port}{path}"

    def get_json(self, path: str, timeout_s: float = 5.0) -> Any:
        with urllib.request.urlopen(self._url(path), timeout=timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))

    def status(self) -> dict[str, Any]:
        """The parsed ``/status`` JSON."""
        data = self.get_json("/status")
        assert isinstance(data, dict)
        return data

    def object_count(self) -> int:
        """Number of KV objects held in the server's L1 (CPU memory) tier."""
        return _find_object_count(self.status())

    def connector_config(self, **extra: Any) -> dict[str, Any]:
        """``kv_connector_extra_config`` entries pointing an LMCacheMPConnector at us."""
        return {
            "lmcache.mp.host": f"tcp://{self.host}",
            "lmcache.mp.port": self.port,
            "lmcache.mp.mq_timeout": 30,
            **extra,
        }

    def log_tail(self, n_bytes: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "<no log>"
        data = self.log_path.read_bytes()
        return data[-n_bytes:].decode("utf-8", errors="replace")

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")


def _find_object_count(status: dict[str, Any]) -> int:
    """Extract the L1 object count from a ``/status`` payload.

    LMCache 0.5.6 reports it as ``storage_manager.l1_managers.<name>.total_object_count``
    (one entry per L1 manager, ``_default`` normally) and mirrors the default one at
    ``storage_manager.l1_manager.total_object_count``.
    """
    storage = status.get("storage_manager", {})
    managers = storage.get("l1_managers")
    if isinstance(managers, dict) and managers:
        return sum(int(m.get("total_object_count", 0)) for m in managers.values())
    single = storage.get("l1_manager")
    if isinstance(single, dict) and "total_object_count" in single:
        return int(single["total_object_count"])
    raise KeyError(f"no L1 total_object_count in /status payload: {sorted(status)}")
