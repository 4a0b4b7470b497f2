"""Headless Chromium driven over the DevTools protocol, for the dashboard test.

No Selenium/Playwright: Debian's ``chromium`` plus a websocket client is all the
protocol needs (``Page.navigate``, ``Runtime.evaluate``, ``Page.captureScreenshot``).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request

#: Flags for CI: no sandbox (root in CI), no GPU, nothing fetched from outside.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking")

#: Text of every ``[data-kvstate]`` element and table row, looking inside Bokeh's shadow roots.
READ_SHOWN = """(() => {
  const out = {}; const rows = []; let canvases = 0;
  const visit = (root) => {
    root.querySelectorAll('[data-kvstate]').forEach(e => { out[e.dataset.kvstate] = e.textContent; });
    root.querySelectorAll('tbody tr').forEach(r => rows.push(Array.from(r.querySelectorAll('td'), td => td.textContent)));
    root.querySelectorAll('canvas').forEach(c => { if (c.width > 0 && c.height > 0) canvases += 1; });
    root.querySelectorAll('*').forEach(e => { if (e.shadowRoot) visit(e.shadowRoot); });
  };
  visit(document);
  return JSON.stringify({shown: out, rows: rows, canvases: canvases, title: document.title});
})()"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page, closed on exit."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1100):
        import websocket  # websocket-client, in the test extras

        self.profile = tempfile.mkdtemp(prefix="kvstate-chromium-")
        self.proc = subprocess.Popen(
            [
                binary,
                *FLAGS,
                f"--user-data-dir={self.profile}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port = self._devtools_port(timeout=30)
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in targets if t.get("type") == "page")
        # Chromium refuses DevTools websockets that send an Origin it does not allow.
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)

    def _devtools_port(self, timeout: float) -> int:
        from distributed.utils_test import poll_for

        path = os.path.join(self.profile, "DevToolsActivePort")
        port: list[int] = []

        def opened() -> bool:  # chromium writes the port to its profile once it listens
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.proc.returncode}")
            with contextlib.suppress(OSError, ValueError), open(path) as f:
                port.append(int(f.readline()))
            return bool(port)

        poll_for(opened, timeout, period=0.1)
        return port[0]

    def call(self, method: str, **params) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def navigate(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return res["result"].get("value")

    def read_page(self) -> dict:
        return json.loads(self.evaluate(READ_SHOWN) or "{}")

    def screenshot(self, path: str) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
