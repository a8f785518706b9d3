"""A server in a child process, for the chapter 10 notebook, ``make chapter-10`` and the tests:
started on a free port, ready once ``/health`` answers, stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ..core.hardware import REPO_ROOT

_URL_LINE = re.compile(r"miniinfer: serving .* at (http://\S+)/v1")


class ServerProcess:
    """``python -m miniinfer serve ... --port 0`` in a child process; its output goes to a log
    file (a pipe nobody reads would fill and block the server)."""

    def __init__(self, model: str, *serve_args: str, timeout: float = 180.0) -> None:
        self.log = Path(tempfile.mkstemp(prefix="miniinfer-serve-", suffix=".log")[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "miniinfer", "serve", "--model", model, "--port", "0",
                 *serve_args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        try:
            self.url = self._wait_ready(timeout)
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise

    @property
    def base_url(self) -> str:
        """What the openai client takes as ``base_url``."""
        return f"{self.url}/v1"

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}:"
                                   f"\n{self.log.read_text()}")
            if url is None:
                match = _URL_LINE.search(self.log.read_text())
                url = match.group(1) if match else None
            if url is not None:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                        if response.status == 200:
                            return url
                except OSError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit status (0 after a clean shutdown)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)
