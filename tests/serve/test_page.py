"""The live cache page in headless Chromium (Debian's ``chromium``), driven over the
DevTools protocol on a pipe: it loads, shows the slots of a server with three live
conversations, and updates after a turn; the screenshot is kept as ``cache-page.png`` in
the test's tmp dir."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve.conftest import ServerProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class DevTools:
    """Chromium with ``--remote-debugging-pipe``: JSON messages over fds 3 and 4, \\0-ended."""

    def __init__(self, profile: Path) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds() -> None:  # runs in the child: the pipe ends become fds 3 and 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--remote-debugging-pipe",
                "--window-size=1100,900",
                "about:blank",
            ],
            preexec_fn=fds,
            pass_fds=(3, 4),  # kept open in the child after fds() made them
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next = 0
        self._buffer = b""
        self.session: str | None = None

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next:
                    if "error" in reply:
                        raise AssertionError(f"{method}: {reply['error']}")
                    result: dict[str, Any] = reply["result"]
                    return result
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise AssertionError("chromium closed the DevTools pipe")
            self._buffer += chunk
        raise AssertionError(f"{method}: no answer in {timeout} s")

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"page never had: {expression}")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.session = None
            self.call("Browser.close", timeout=5)
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


SLOTS_JS = (
    "JSON.stringify([...document.querySelectorAll('#slots tr.slot')].map(r => "
    "[r.dataset.slot, r.dataset.conversation, +r.dataset.cells]))"
)


def turn(server: ServerProcess, conversation: str, text: str) -> dict[str, Any]:
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": text}],
            "conversation": conversation,
            "max_tokens": 6,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.slow
def test_cache_page_in_chromium(tiny_llama3_path: Path, start_server: Any, tmp_path: Path) -> None:
    assert Path(CHROMIUM).exists(), "Debian's chromium is needed (.ci/run installs it)"
    server: ServerProcess = start_server(tiny_llama3_path, "--n-ctx", "512", "--slots", "4")
    for name in ("alice", "bob", "carol"):
        turn(server, name, f"hello from {name}")
    with tempfile.TemporaryDirectory() as profile:
        browser = DevTools(Path(profile))
        try:
            browser.open(f"{server.url}/")
            browser.wait_for("+document.body.dataset.updates > 0")
            slots = json.loads(browser.wait_for(SLOTS_JS))
            assert len(slots) == 4
            shown = {conversation: cells for _, conversation, cells in slots if conversation}
            assert set(shown) == {"alice", "bob", "carol"}
            with server.store() as store:
                # The cells shown are the prompt and the reply in the cache (the last token
                # sampled is never decoded).
                for name, cells in shown.items():
                    last = store.turns(name)[-1]
                    assert cells == last.prompt_tokens + last.generated_tokens - 1
            assert browser.evaluate("document.getElementById('turns').dataset.count") == "3"
            assert browser.evaluate("+document.getElementById('hitchart').dataset.points") == 3
            assert browser.evaluate("+document.getElementById('queuechart').dataset.points") == 3
            queue = browser.evaluate("document.getElementById('queue').textContent")
            assert queue.startswith("p50 ") and " · p95 " in queue, queue
            browser.screenshot(tmp_path / "cache-page-before.png")

            reply = turn(server, "bob", "and a second question from bob")
            grown = reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] - 1
            browser.wait_for(
                "document.getElementById('turns').dataset.count === '4' && "
                f"document.querySelector('tr.slot[data-conversation=bob]').dataset.cells == {grown}"
            )
            status = browser.evaluate("document.getElementById('status').textContent")
            assert "tiny-llama3.gguf" in status and "4 slots" in status
            browser.screenshot(tmp_path / "cache-page.png")
        finally:
            browser.close()
    assert (tmp_path / "cache-page.png").stat().st_size > 10_000
