"""The page at / in a real browser (Debian's chromium through chromedriver and Selenium),
against a live ``pyllmrouter serve`` with an API key on two emulated GPUs: GPU0 holds one
of the two models pinned to it, GPU1 the rest.  Skips, saying why, where no browser is
installed (scripts/setup.sh --test installs it where apt can be used)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from pyllmrouter import ModelSpec
from pyllmrouter.engine.probe import probe
from pyllmrouter.remote import request
from pyllmrouter.tools import scripted
from pyllmrouter.tools.loopback import start_serve
from test_handover import metric
from test_live import wait_for

pytestmark = pytest.mark.slow

KEY = "page-test-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def _why_no_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (scripts/setup.sh --test installs it)"
    if not CHROMIUM or not DRIVER:
        return "no chromium/chromedriver (scripts/setup.sh --test installs Debian's with apt, as root)"
    return None


def _api(base: str, method: str, path: str, body: dict | None = None) -> dict:
    status, data = request(base, method, path, body, KEY)
    assert status == 200, data
    return data


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    why = _why_no_browser()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("page")
    think = scripted.write_scripted(d / "think.gguf", scripted.THINK_TEMPLATE, scripted.THINK_SCRIPT)
    story = scripted.write_scripted(d / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
    tool = scripted.write_scripted(d / "tool.gguf", scripted.TOOL_TEMPLATE, scripted.TOOL_SCRIPT)
    coder, other = (probe(ModelSpec(str(p), ("-c", "2048"))).total for p in (tool, tiny["tiny-llama"]))
    gpu0 = max(coder, other) + min(coder, other) // 2  # one of the two pinned models at a time
    preset = d / "models.ini"
    preset.write_text(f"""version = 1
[*]
memory-margin = 0
c = 2048

[chat]
model = {think}
alias = assistant

[story]
model = {story}
c = 32768
metrics = true

[coder]
model = {tool}
device = GPU0

[other]
model = {tiny["tiny-llama"]}
device = GPU0
""")
    proc, base = start_serve(["--models-preset", str(preset), "--api-key", KEY,
                              "--emulate-devices", f"GPU0={gpu0},GPU1={1 << 30}"])
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def chromium(*args: str):
    """Debian's chromium, headless, under chromedriver, with ``args`` added; its console
    logged (``driver.get_log("browser")``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", *args):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=opts)


@pytest.fixture(scope="module")
def browser(server):
    driver = chromium("--window-size=1400,1100")
    try:
        yield driver
    finally:
        driver.quit()


def _open(driver, base: str, key: str | None) -> None:
    driver.get(base + "/")
    if key is None:
        driver.execute_script("localStorage.removeItem('pyllmrouter-api-key')")
    else:
        driver.execute_script("localStorage.setItem('pyllmrouter-api-key', arguments[0])", key)
    driver.get_log("browser")  # what the first visit logged (before the key was set) is not this page's
    driver.refresh()


def _ready(driver, base: str) -> None:
    _open(driver, base, KEY)
    wait_for(lambda: driver.execute_script("return document.body.dataset.ready === '1'"), what="the first render")
    wait_for(lambda: driver.find_element("id", "live").text == "live", what="the live event stream")


def _bars(driver) -> dict[str, list[dict]]:
    return driver.execute_script("""
        const out = {};
        for (const bar of document.querySelectorAll('.bar')) {
            out[bar.dataset.device] = [...bar.children].map(s => ({kind: s.dataset.kind, model: s.dataset.model || null,
                component: s.dataset.component || null, bytes: Number(s.dataset.bytes)}));
        }
        return out;""")


def _state(driver, model: str) -> str:
    return driver.execute_script(
        "const r = document.querySelector(`#models tr[data-model='${arguments[0]}'] .state`);"
        "return r ? r.textContent : null;", model)


def _click(driver, model: str, action: str) -> None:
    """Click a model's button (the table is drawn anew on each event: found again if it was)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(50):
        try:
            return driver.find_element("css selector", f"#models tr[data-model='{model}'] "
                                                       f"button[data-action='{action}']").click()
        except StaleElementReferenceException:
            time.sleep(0.05)
    raise AssertionError(f"the {action} button of {model} kept being redrawn")


def test_the_page_loads_with_no_console_error(server, browser):
    _ready(browser, server)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    assert browser.find_element("id", "auth").is_displayed() is False
    assert {"GPU0", "GPU1", "CPU"} <= set(_bars(browser))
    # the key is never in the page itself
    assert KEY not in browser.page_source


def test_the_bars_bytes_equal_devices_and_models(server, browser):
    _api(server, "POST", "/models/load", {"model": "chat"})
    _ready(browser, server)
    wait_for(lambda: _state(browser, "chat") == "loaded", what="chat loaded")
    bars, models = _bars(browser), _api(server, "GET", "/models")
    devices = _api(server, "GET", "/devices")["devices"]
    for m in models["data"]:
        for device, held in m["memory"]["held"].items():
            mine = {s["component"]: s["bytes"] for s in bars[device] if s["model"] == m["id"]}
            assert mine == m["memory"]["parts"][device]
            assert sum(mine.values()) == held  # the model's parts are exactly what admission counts
    for name in ("GPU0", "GPU1"):  # emulated: nothing else moves their numbers
        segs, d = bars[name], devices[name]
        by_kind = {}
        for s in segs:
            by_kind[s["kind"]] = by_kind.get(s["kind"], 0) + s["bytes"]
        assert by_kind.get("model", 0) + by_kind.get("overhead", 0) == d["held"]
        assert by_kind.get("free", 0) == max(0, d["available"])
        assert sum(by_kind.values()) == d["total"]
    assert sum(s["bytes"] for s in bars["GPU1"] if s["model"] == "chat") > 0


def test_a_load_click_loads_the_model_and_its_bar_grows(server, browser):
    _ready(browser, server)
    before = sum(s["bytes"] for s in _bars(browser)["GPU1"] if s["kind"] == "model")
    assert _state(browser, "story") == "unloaded"
    _click(browser, "story", "load")
    wait_for(lambda: _state(browser, "story") == "loaded", what="story loaded")
    held = next(m for m in _api(server, "GET", "/models")["data"] if m["id"] == "story")["memory"]["held"]["GPU1"]
    wait_for(lambda: sum(s["bytes"] for s in _bars(browser)["GPU1"] if s["kind"] == "model") == before + held,
           what="the GPU1 bar to grow by story's bytes")


def test_an_eviction_shows_in_events(server, browser):
    _ready(browser, server)
    _click(browser, "coder", "load")
    wait_for(lambda: _state(browser, "coder") == "loaded", what="coder loaded")
    _click(browser, "other", "load")  # GPU0 holds one of them: coder, idle, is evicted
    wait_for(lambda: _state(browser, "other") == "loaded", what="other loaded")
    evicted = wait_for(lambda: browser.find_elements("css selector", "#events li[data-event='evicted'][data-model='coder']"),
                     what="the eviction in Events")
    assert "GPU0" in evicted[0].text and "other" in evicted[0].text
    assert _state(browser, "coder") == "unloaded"
    assert _state(browser, "chat") == "loaded"  # on GPU1: not touched


def test_a_chat_streams_with_reasoning_apart_and_stop_frees_the_model(server, browser):
    from selenium.webdriver.support.ui import Select

    _ready(browser, server)
    Select(browser.find_element("id", "chat-model")).select_by_value("assistant")  # an alias
    browser.find_element("id", "chat-text").send_keys("hello")
    browser.find_element("id", "chat-send").click()
    status = browser.find_element("id", "chat-status")
    wait_for(lambda: status.get_attribute("data-state") == "done", what="the thinking model's answer")
    last = browser.find_elements("css selector", "#chat-log .msg.assistant")[-1]
    assert "The user says hello" in last.find_element("css selector", ".reasoning").text
    assert last.find_element("css selector", ".answer").text == "Hello there!"

    Select(browser.find_element("id", "chat-model")).select_by_value("story")
    browser.find_element("id", "chat-text").send_keys("tell me a story")
    browser.find_element("id", "chat-send").click()
    answer = lambda: browser.find_elements("css selector", "#chat-log .msg.assistant .answer")[-1]  # noqa: E731
    wait_for(lambda: answer().text.count("Once upon a time") >= 2, what="tokens streaming in")
    stop = browser.find_element("id", "chat-stop")
    assert stop.is_enabled()
    chunks = lambda: int(answer().get_attribute("data-chunks"))  # noqa: E731
    log = browser.find_element("id", "chat-log")
    below = lambda: stop.rect["y"] - log.rect["y"]  # noqa: E731
    at, seen = below(), chunks()
    wait_for(lambda: chunks() > seen + 300, what="more of the story")
    assert below() == at  # the button stays put under the log while the answer grows
    story = lambda: next(m for m in _api(server, "GET", "/models")["data"] if m["id"] == "story")  # noqa: E731
    assert story()["in_flight"] == 1  # still generating: up to its slot's context
    stop.click()
    wait_for(lambda: status.get_attribute("data-state") == "stopped", what=f"the stop ({status.text!r})")
    wait_for(lambda: story()["in_flight"] == 0, timeout=5, what="the lease freed by the stop")
    shown = answer().text
    time.sleep(0.5)
    assert answer().text == shown  # nothing more comes
    n_ctx = _api(server, "GET", "/slots?model=story")[0]["n_ctx"]  # llama-server's own accounts
    tokens = metric(server, "llamacpp:n_tokens_max", "story", {"Authorization": f"Bearer {KEY}"})
    assert tokens < n_ctx - 100  # cut short, not run to its end

    shots = os.environ.get("PYLLMROUTER_SCREENSHOT_DIR")
    if shots:
        browser.execute_script("window.scrollTo(0, 0)")
        Path(shots).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(shots) / "page.png"))


def test_a_wrong_api_key_shows_a_clear_message(server, browser):
    _open(browser, server, "not-the-key")
    msg = wait_for(lambda: browser.find_element("id", "auth-msg").text, what="the key message")
    assert browser.find_element("id", "auth").is_displayed()
    assert "refused this browser's API key" in msg and "invalid or missing API key" in msg
    assert browser.find_element("id", "live").text == "API key needed"
    _open(browser, server, None)
    msg = wait_for(lambda: "asks for an API key" in browser.find_element("id", "auth-msg").text and
                 browser.find_element("id", "auth-msg").text, what="the no-key message")
    # the right key, typed into the page, opens it
    browser.find_element("id", "auth-key").send_keys(KEY)
    browser.find_element("css selector", "#auth-form button").click()
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready === '1'"), what="the page with the key")
    assert browser.execute_script("return localStorage.getItem('pyllmrouter-api-key')") == KEY
    assert not browser.find_element("id", "auth").is_displayed()


def test_twenty_models_on_eight_devices_stay_readable(tiny, tmp_path, browser):
    """Every bar and every model is there, nothing spills sideways, and the models table
    scrolls in its own box instead of pushing events and chat off the page."""
    lines = ["version = 1", "[*]", "memory-margin = 0", "c = 512"]
    for i in range(20):
        lines += [f"[model-{i:02d}]", f"model = {tiny['tiny-llama']}"] + ([f"device = GPU{i % 8}"] if i % 3 else [])
    preset = tmp_path / "twenty.ini"
    preset.write_text("\n".join(lines) + "\n")
    devices = ",".join(f"GPU{i}={(i + 1) * 8_000_000}" for i in range(8))
    proc, base = start_serve(["--models-preset", str(preset), "--api-key", KEY, "--emulate-devices", devices])
    try:
        for i in range(0, 20, 2):
            _api(base, "POST", "/models/load", {"model": f"model-{i:02d}"})
        _ready(browser, base)
        wait_for(lambda: _state(browser, "model-18") == "loaded", what="the loaded models")
        assert set(_bars(browser)) == {f"GPU{i}" for i in range(8)} | {"CPU"}
        assert len(browser.find_elements("css selector", "#models tbody tr")) == 20
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        box = browser.find_element("css selector", "#models-section .scroll")
        assert box.size["height"] < 600 and browser.execute_script(
            "return arguments[0].scrollHeight > arguments[0].clientHeight", box)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_model_s_instances_show_where_each_is_and_how_busy(tmp_path, browser):
    """replicas = 2: two held streams on a one-slot model start a second instance on the
    other GPU; the model's row lists both, each with its device and its requests."""
    from test_scheduling import Streams

    story = scripted.write_scripted(tmp_path / "story.gguf", scripted.THINK_TEMPLATE, scripted.STORY_SCRIPT, loop=True)
    one = probe(ModelSpec(str(story), ("-np", "1", "-c", "2048", "--context-shift"))).total
    preset = tmp_path / "hot.ini"
    preset.write_text(f"version = 1\n[*]\nmemory-margin = 0\n\n[hot]\nmodel = {story}\nnp = 1\nc = 2048\ncontext-shift = true\nreplicas = 2\n")
    gpu = one + one // 2  # one instance per GPU
    proc, base = start_serve(["--models-preset", str(preset), "--api-key", KEY,
                              "--emulate-devices", f"GPU0={gpu},GPU1={gpu}"])
    streams = Streams(base, {"Authorization": f"Bearer {KEY}"})
    try:
        streams.open("hot")
        streams.open("hot")
        wait_for(lambda: any(m["id"] == "hot" and len(m["instances"]) == 2 and m["instances"][1]["state"] == "loaded"
                             for m in _api(base, "GET", "/models")["data"]), what="the second instance")
        _ready(browser, base)
        lines = lambda: browser.execute_script(  # noqa: E731
            "return [...document.querySelectorAll(\"#models tr[data-model='hot'] .instances div\")]"
            ".map(d => d.textContent)")
        wait_for(lambda: len(lines()) == 2, what="both instances on the page")
        first, second = lines()
        assert first.startswith("hot: loaded on GPU") and first.endswith("2 in flight")
        assert second.startswith("hot#2: loaded on GPU") and second.split(" on ")[1][:4] != first.split(" on ")[1][:4]
        assert len(browser.find_elements("css selector", "#models tbody tr")) == 1  # one model, not two
    finally:
        streams.close()
        proc.terminate()
        proc.wait(30)
