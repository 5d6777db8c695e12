"""Why vLLM's engine failed to start, in vLLM's own words.

vLLM builds its EngineCore in a child process. When that fails (a pool too small for ``max_model_len``, a model
that does not load), the parent only gets ``RuntimeError: Engine core initialization failed. See root cause
above``; the root cause is the last line of the traceback the child printed on its standard error, which a Ray
replica's user never sees (it goes to Ray's session logs). ``StderrTap`` sits on this process's file descriptor 2,
which the child inherits: a thread copies everything through to where it went before (nothing is lost from the
logs) and keeps the last lines, so the replica can say ``ValueError: To serve at least one request with the
model's max seq len (2048), ...`` instead.
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time

# The last line of a Python traceback: ``ValueError: ...``, ``torch.OutOfMemoryError: ...``
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt): .+")
GENERIC = ("Engine core initialization failed",)  # vLLM's parent-side summary, never the cause


class StderrTap:
    """Installed once per process (``StderrTap.install()``); ``mark()`` and ``error_since(mark)`` find the last
    exception line written to standard error after a point."""

    _installed: StderrTap | None = None
    _lock = threading.Lock()

    def __init__(self, keep: int = 400) -> None:
        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=keep)
        self.count = 0
        self._partial = b""
        read, write = os.pipe()
        self._out = os.dup(2)  # where standard error went before: everything is still written there
        os.dup2(write, 2)
        os.close(write)
        self._read = read
        threading.Thread(target=self._pump, name="stderr-tap", daemon=True).start()

    @classmethod
    def install(cls) -> StderrTap:
        with cls._lock:
            if cls._installed is None:
                cls._installed = cls()
            return cls._installed

    def mark(self) -> int:
        return self.count

    def error_since(self, mark: int, wait_s: float = 2.0) -> str:
        """The last exception line written since ``mark`` (without vLLM's log prefix), or "". Waits up to
        ``wait_s`` for one: the child's traceback may still be on its way through the pipe."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self._last_error(mark)
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def _last_error(self, mark: int) -> str:
        found = ""
        for n, line in list(self.lines):
            if n < mark:
                continue
            text = line.rsplit("] ", 1)[-1] if line.startswith("(") else line  # "(EngineCore pid=1) ERROR ... ] X"
            text = text.strip()
            if EXCEPTION_LINE.match(text) and not any(g in text for g in GENERIC):
                found = text
        return found

    def _pump(self) -> None:
        while True:
            try:
                data = os.read(self._read, 65536)
            except OSError:
                return
            if not data:
                return
            try:
                os.write(self._out, data)
            except OSError:
                pass
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()[-65536:]
            for raw in lines:
                self.count += 1
                self.lines.append((self.count, raw.decode(errors="replace")))
