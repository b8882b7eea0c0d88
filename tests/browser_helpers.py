"""Headless Chromium and TensorBoard for the browser tests (tests/board/test_browser.py, test_traces_tab.py,
test_traces_lanes.py).

The browser runs offline (every host but 127.0.0.1 unresolvable) and is driven over the DevTools protocol on a pipe
(no extra packages). TensorBoard (detector/board/launcher.py) serves a folder of runs on 127.0.0.1 in a process group
of its own. Screenshots go to the test's tmp folder, and to $TENSORBOARD_SCREENSHOTS when set.
"""

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import child_env

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PADDED, FAST = "profile/padded/20261122-031500", "profile/synthetic_2x/20261122-031600"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def get_json(url: str):
    return json.loads(get(url))


DEEP_TEXT = """(() => {  // text of the page, shadow roots included, and how many images have loaded
  const texts = []; let images = 0;
  const visit = (node) => {
    if (node.nodeType === Node.TEXT_NODE) texts.push(node.data);
    if (node.tagName === 'IMG' && node.complete && node.naturalWidth > 0) images++;
    if (node.shadowRoot) visit(node.shadowRoot);
    if (node.tagName === 'IFRAME' && node.contentDocument) visit(node.contentDocument);  // a plugin's page
    for (const child of node.childNodes) visit(child);
  };
  visit(document);
  return JSON.stringify({text: texts.join(' ').replace(/\\s+/g, ' '), images});
})()"""

CLICK_ACTUAL_SIZE = """(() => {  // tick the Images dashboard's "Show actual image size"
  const find = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName === 'PAPER-CHECKBOX' && el.textContent.includes('Show actual image size')) return el;
      const inner = el.shadowRoot && find(el.shadowRoot);
      if (inner) return inner;
    }
    return null;
  };
  const box = find(document);
  if (box && !box.checked) box.click();
  return Boolean(box);
})()"""


class Chromium:
    """Headless Chromium, offline, driven with the DevTools protocol over --remote-debugging-pipe
    (NUL-terminated JSON: commands on its fd 3, replies and events on its fd 4)."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000):
        self.profile = profile
        to_browser, self.commands = os.pipe()
        self.replies, from_browser = os.pipe()

        def as_fds_3_and_4():  # in the child; via fds >= 10 so that neither dup2 overwrites the other pipe
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
            + ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
            + ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", f"--user-data-dir={profile}"]
            + ["--remote-debugging-pipe", f"--window-size={width},{height}", "about:blank"],
            preexec_fn=as_fds_3_and_4,
            close_fds=False,  # keep fds 3 and 4 (dup2 makes them inheritable; Python's own fds are not)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_browser)
        os.close(from_browser)
        self.buffer, self.last_id = b"", 0
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def send(self, method: str, timeout: float = 30, **params) -> dict:
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params}
        if getattr(self, "session", None):
            message["sessionId"] = self.session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self.buffer:
                ready, _, _ = select.select([self.replies], [], [], max(0.0, deadline - time.monotonic()))
                assert ready, f"Chromium did not answer {method} within {timeout} s"
                chunk = os.read(self.replies, 1 << 20)
                assert chunk, "Chromium closed its DevTools pipe"
                self.buffer += chunk
            raw, _, self.buffer = self.buffer.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") == self.last_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]

    def evaluate(self, expression: str):
        return self.send("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def show(self, url: str, expected: list[str], images: int = 0, timeout: float = 60) -> str:
        """Open ``url``; wait until its text (shadow DOM included) holds every ``expected`` string and at
        least ``images`` images have loaded. Returns the text; fails naming what is missing."""
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while True:
            page = json.loads(self.evaluate(DEEP_TEXT) or '{"text": "", "images": 0}')
            missing = [s for s in expected if s not in page["text"]]
            if not missing and page["images"] >= images:
                return page["text"]
            assert time.monotonic() < deadline, f"{url}: after {timeout} s, missing {missing}, {page['images']} images"
            time.sleep(0.5)

    def screenshot(self, path: Path) -> Path:
        time.sleep(1)  # let the last layout settle
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self):
        try:
            self.send("Browser.close", timeout=10)
        except (AssertionError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        os.close(self.commands)
        os.close(self.replies)


def keep(shot: Path) -> None:
    """Copy a screenshot to $TENSORBOARD_SCREENSHOTS (docs/) when set."""
    if os.environ.get("TENSORBOARD_SCREENSHOTS"):
        shutil.copy(shot, Path(os.environ["TENSORBOARD_SCREENSHOTS"]) / shot.name)


def serve(logdir: Path, runs: list[str]):
    """TensorBoard (detector/board/launcher.py) on 127.0.0.1 over ``logdir``, once it lists ``runs``: (url, stop),
    stop() ending its whole process group."""
    port = free_port()
    env = child_env()
    script = "import sys; from detector.board.launcher import main; main(sys.argv[1], int(sys.argv[2]))"
    log = open(logdir.parent / "tensorboard.log", "wb")  # noqa: SIM115  closed by stop()
    server = subprocess.Popen(
        [sys.executable, "-c", script, str(logdir), str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )

    def stop():
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()

    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            if set(runs) <= set(get_json(f"{url}/data/runs")) and get_json(f"{url}/data/plugins_listing"):
                return url, stop
        except OSError:
            pass  # not listening yet
        if server.poll() is not None or time.monotonic() > deadline:
            stop()
            raise AssertionError((logdir.parent / "tensorboard.log").read_text()[-3000:])
        time.sleep(1)


# ----------------------------------------------------------------------------- inside the Traces tab

IN_TRACES = """((body) => {  // run body(doc, win) inside the Traces tab's iframe; JSON of its result
  const find = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName === 'IFRAME' && (el.src || '').includes('name=traces')) return el;
      const inner = el.shadowRoot && find(el.shadowRoot);
      if (inner) return inner;
    }
    return null;
  };
  const frame = find(document);
  if (!frame || !frame.contentDocument) return JSON.stringify(null);
  return JSON.stringify(body(frame.contentDocument, frame.contentWindow));
})(%s)"""


def in_traces(browser, body: str):
    return json.loads(browser.evaluate(IN_TRACES % body) or "null")


def wait_for(browser, body: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        found = in_traces(browser, body)
        if found:
            return found
        assert time.monotonic() < deadline, f"the Traces tab did not show {body!r} within {timeout} s"
        time.sleep(0.25)
