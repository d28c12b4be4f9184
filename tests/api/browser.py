"""Headless Chromium through the DevTools protocol (tests only): load a page, collect console errors
and uncaught exceptions, count the plotly charts that rendered.

    with Chromium() as browser:
        result = browser.load("http://127.0.0.1:8123/dashboard/")
        assert result.errors == [] and result.rendered == result.charts > 0
        result = browser.load(url, actions=["document.forms[0].submit()"], wait_for="document.title")

Debian's ``chromium`` at /usr/bin/chromium (``CHROMIUM`` overrides); tests skip without it. The
network is off: every host but the loopback ones is unresolvable (``--host-resolver-rules``), so a
page that needs a CDN fails with errors. One browser keeps its cookies across ``load`` calls. An
action is JavaScript that makes the page navigate (a form submitted); each waits for the next page.
``wait_for`` is a JavaScript expression polled until truthy; its last value is ``result.probe``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Self

import websockets

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"

_CHARTS_JS = """JSON.stringify({charts: document.querySelectorAll('.plotly-graph-div').length,
  rendered: document.querySelectorAll('.js-plotly-plot .main-svg').length > 0 ?
    Array.from(document.querySelectorAll('.plotly-graph-div')).filter(d => d.querySelector('.main-svg')).length : 0,
  title: document.title, plotly: typeof window.Plotly, href: location.href})"""

# every host but loopback is unresolvable: the page gets no network beyond this machine's servers
OFFLINE_RULES = "MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1"


def available() -> bool:
    return os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)


@dataclass
class PageResult:
    url: str
    charts: int = 0
    rendered: int = 0
    title: str = ""
    plotly: str = ""
    href: str = ""
    probe: object = None
    errors: list[str] = field(default_factory=list)


class Chromium:
    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self.ws_url = ""

    def __enter__(self) -> Self:
        self.profile = tempfile.mkdtemp(prefix="livestep-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
             f"--host-resolver-rules={OFFLINE_RULES}",
             f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + self.timeout_s
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            m = re.search(r"(ws://\S+)", line)
            if m:
                self.ws_url = m.group(1)
                return self
            if not line and self.proc.poll() is not None:
                break
        self.__exit__(None, None, None)
        raise RuntimeError("chromium did not print its DevTools URL")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(getattr(self, "profile", ""), ignore_errors=True)

    def load(self, url: str, settle_s: float = 8.0, actions: list[str] = (), wait_for: str | None = None) -> PageResult:
        return asyncio.run(self._load(url, settle_s, list(actions), wait_for))

    async def _load(self, url: str, settle_s: float, actions: list[str], wait_for: str | None) -> PageResult:
        res = PageResult(url)
        ids = itertools.count(1)
        async with websockets.connect(self.ws_url, max_size=64 << 20) as ws:
            pending: dict[int, asyncio.Future] = {}
            events: asyncio.Queue = asyncio.Queue()

            async def reader():
                async for raw in ws:
                    msg = json.loads(raw)
                    if "id" in msg and msg["id"] in pending:
                        pending.pop(msg["id"]).set_result(msg)
                    else:
                        await events.put(msg)

            task = asyncio.create_task(reader())

            async def call(method, params=None, session=None):
                i = next(ids)
                fut = asyncio.get_running_loop().create_future()
                pending[i] = fut
                msg = {"id": i, "method": method, "params": params or {}}
                if session:
                    msg["sessionId"] = session
                await ws.send(json.dumps(msg))
                out = await asyncio.wait_for(fut, self.timeout_s)
                if "error" in out:
                    raise RuntimeError(f"{method}: {out['error']}")
                return out.get("result", {})

            target = (await call("Target.createTarget", {"url": "about:blank"}))["targetId"]
            sid = (await call("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
            for m in ("Runtime.enable", "Log.enable", "Page.enable"):
                await call(m, session=sid)
            await call("Page.navigate", {"url": url}, session=sid)
            loaded = False
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                try:
                    ev = await asyncio.wait_for(events.get(), 0.2)
                except TimeoutError:
                    ev = None
                if ev is not None:
                    self._collect(ev, res)
                    loaded = loaded or ev.get("method") == "Page.loadEventFired"
                if loaded and actions:  # the next page: run the action, wait for its load event
                    await call("Runtime.evaluate", {"expression": actions.pop(0)}, session=sid)
                    loaded = False
                    continue
                if loaded:
                    out = await call("Runtime.evaluate", {"expression": _CHARTS_JS, "returnByValue": True}, session=sid)
                    info = json.loads(out["result"]["value"])
                    res.charts, res.rendered, res.title, res.plotly, res.href = (
                        info["charts"], info["rendered"], info["title"], info["plotly"], info["href"])
                    if wait_for is not None:
                        got = await call("Runtime.evaluate", {"expression": wait_for, "returnByValue": True},
                                         session=sid)
                        res.probe = got.get("result", {}).get("value")
                    done = res.rendered >= res.charts and (wait_for is None or bool(res.probe))
                    if done or time.monotonic() > deadline - self.timeout_s + settle_s:
                        break
            await asyncio.sleep(0.2)  # late console messages
            while not events.empty():
                self._collect(events.get_nowait(), res)
            if not loaded:
                res.errors.append("the page did not finish loading")
            await call("Target.closeTarget", {"targetId": target})
            task.cancel()
        return res

    @staticmethod
    def _collect(ev: dict, res: PageResult) -> None:
        m, p = ev.get("method"), ev.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            res.errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            res.errors.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            res.errors.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
