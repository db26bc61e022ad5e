"""The chat page (issue 39, item 4) in a real browser: headless Chromium driven by selenium against a live CPU
server of the tiny random model with an API key.

The page asks for the key and then lists the model; a prompt with a system prompt streams (the reply is seen
growing), ends with the tokens/s readout, and a second turn sends the whole conversation (the server sees it);
Stop (or New chat) ends a long reply mid-stream and the server cancels its generation; replies render markdown
and never become markup (the renderer's output holds only its own tags, and a reply full of HTML shows as text).

The serving engine never stops at an end-of-sequence token (a random model would end replies at random) and its
steps can be slowed (``ThrottledBackend.delay``) so that streaming is slow enough to watch and to stop.

Without selenium, Chromium or chromedriver the tests skip saying what is missing, unless ``CI=true``: then they
fail (``.ci/run`` installs the browser)."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

pytest.importorskip("fastapi")

from realizar.engine import load_engine  # noqa: E402
from tests.gguf_factory import shared_tiny_gguf  # noqa: E402
from tests.test_server import LiveServer, ThrottledBackend, _sample, _wait_idle  # noqa: E402

KEY = "sk-chat-page"
WAIT = 20  # seconds any one thing may take to show in the page


def _missing_browser() -> str | None:
    """Why no browser test can run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install '.[test]')"
    missing = [name for name in ("chromium", "chromedriver") if _which(name) is None]
    if missing:
        return f"no {' or '.join(missing)} on PATH (Debian: apt-get install chromium chromium-driver)"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or (shutil.which("chromium-browser") if name == "chromium" else None)


def _require_browser() -> None:
    """Skip, naming what is missing, when no browser test can run here; under ``CI=true`` fail instead."""
    reason = _missing_browser()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and the chat page's browser test cannot run: {reason}", pytrace=False)
    pytest.skip(f"chat page browser test: {reason}")


def test_a_missing_browser_skips_but_fails_under_ci(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium or chromedriver on PATH"):
        _require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and the chat page's browser test cannot run"):
        _require_browser()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1200,900", f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=_which("chromedriver")), options=options)
    driver.set_page_load_timeout(WAIT)
    driver.set_script_timeout(WAIT)
    yield driver
    driver.quit()


def _serving(engine):
    """A slowable serving engine for ``engine`` (CPU) that stops a reply at max_tokens only."""
    from realizar.serving import ServingEngine
    from realizar.serving.cpu_backend import ReferenceBatchBackend

    blocks = 8 * (-(-engine.context_length // 32)) + 1
    backend = ThrottledBackend(ReferenceBatchBackend(engine.model, blocks, 32, kv_dtype="f32", max_batch=8))
    return ServingEngine(backend, engine.tokenizer, eos_token_ids=())


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    engine = load_engine(str(shared_tiny_gguf(tmp_path_factory)), device="cpu")
    seen = []  # the messages of each chat request, as the server got them
    render = engine.chat_prompt

    def recording(messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        return render(messages, *args, **kwargs)

    engine.chat_prompt = recording
    srv = LiveServer(engine, api_key=KEY, serving=_serving(engine)).start()
    srv.seen = seen
    yield srv
    srv.stop()


# ----------------------------------------------------------------------------------------------
# driving the page
# ----------------------------------------------------------------------------------------------


def _until(driver, condition, what: str, timeout: float = WAIT):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.02).until(lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"the page did not show {what} within {timeout} s") from None


def _js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def _open(driver, live) -> None:
    """Load the page with nothing stored, give it the API key it asks for, and wait for the model list."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(live.url + "/")
    _js(driver, "localStorage.clear()")
    driver.get(live.url + "/")
    _until(driver, lambda d: "API key" in d.find_element(By.ID, "error").text, "the request for an API key")
    driver.find_element(By.ID, "api-key").send_keys(KEY + Keys.TAB)  # (the change event lists the models again)
    _until(driver, lambda d: _js(d, "return document.getElementById('model').value") == live.engine.name,
           "the model's id in the model list")
    assert driver.find_element(By.ID, "error").text == ""


def _set(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _reply(driver) -> dict:
    """The last assistant message's text and whether it is still streaming, and the Stop button's state."""
    return _js(driver, """
        const m = [...document.querySelectorAll('#messages .message.assistant')].pop();
        return {text: m ? m.textContent : null, streaming: !!m && m.classList.contains('streaming'),
                stop: !document.getElementById('stop').disabled};""")


def _send(driver, prompt: str) -> None:
    from selenium.webdriver.common.by import By

    _set(driver, "prompt", prompt)
    driver.find_element(By.ID, "send").click()


def _watch_stream(driver, until_texts: int = 0) -> list[str]:
    """The distinct non-empty texts the streaming reply showed, read until it ended (or, with ``until_texts``,
    until that many were seen)."""
    seen: list[str] = []
    deadline = time.monotonic() + WAIT
    _until(driver, lambda d: _reply(d)["stop"], "the reply starting")
    while time.monotonic() < deadline:
        r = _reply(driver)
        if r["text"] and (not seen or seen[-1] != r["text"]):
            seen.append(r["text"])
        if not r["streaming"] or (until_texts and len(seen) >= until_texts):
            return seen
        time.sleep(0.01)
    raise AssertionError(f"the reply was still streaming after {WAIT} s")


def _messages(driver) -> list[tuple[str, str]]:
    return [tuple(x) for x in _js(driver, """return [...document.querySelectorAll('#messages .message')]
        .map(m => [m.classList.contains('user') ? 'user' : 'assistant', m.textContent]);""")]


# ----------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------


def test_a_streamed_reply_then_a_second_turn(browser, live):
    from selenium.webdriver.common.by import By

    live.backend.delay = 0.08  # (a token each 80 ms: the growth is there to see)
    try:
        _open(browser, live)
        _set(browser, "system", "Answer in French.")
        _set(browser, "temperature", "0")
        _set(browser, "max-tokens", "12")
        _js(browser, """window.sent = []; const fetch0 = window.fetch;
            window.fetch = (url, init) => { if (init && init.body) window.sent.push(JSON.parse(init.body));
                                            return fetch0(url, init); };""")
        before = len(live.seen)
        _send(browser, "Name a city in France.")
        partials = _watch_stream(browser)
        assert len(partials) >= 2, f"the reply did not grow while streaming: {partials}"
        assert all(partials[-1].startswith(p) for p in partials[:-1])
        _until(browser, lambda d: not _reply(d)["stop"], "the reply ending")
        tps = browser.find_element(By.ID, "tps").text
        rate = r"12 tokens · \d+(\.\d+)? tok/s · first token after \d+\.\d\d s · cut at max tokens"
        assert re.fullmatch(rate, tps), tps
        assert live.seen[before] == [{"role": "system", "content": "Answer in French."},
                                     {"role": "user", "content": "Name a city in France."}]
        (body,) = _js(browser, "return window.sent")
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0 and body["max_tokens"] == 12 and body["model"] == live.engine.name

        _send(browser, "And in Spain?")
        _watch_stream(browser)
        _until(browser, lambda d: not _reply(d)["stop"], "the second reply ending")
        shown = _messages(browser)
        assert [role for role, _ in shown] == ["user", "assistant", "user", "assistant"]
        assert shown[0][1] == "Name a city in France." and shown[2][1] == "And in Spain?"
        got = live.seen[-1]
        assert [m["role"] for m in got] == ["system", "user", "assistant", "user"]
        assert got[1]["content"] == "Name a city in France." and got[3]["content"] == "And in Spain?"
        assert got[2]["content"] and got[2]["content"] == _js(browser, "return window.sent[0] && window.sent[1]"
                                                                       ".messages[2].content")

        browser.find_element(By.ID, "new-chat").click()
        assert _messages(browser) == [] and browser.find_element(By.ID, "tps").text == ""
    finally:
        live.backend.delay = 0.0


def test_stop_ends_the_reply_and_the_generation(browser, live):
    from selenium.webdriver.common.by import By

    backend = live.backend
    _open(browser, live)
    _set(browser, "max-tokens", "150")
    cancelled0 = _sample(_wait_idle(live), "realizar_requests_cancelled")
    backend.delay = 0.1  # (150 tokens would take 15 s)
    try:
        decodes0 = backend.decodes
        _send(browser, "Tell me a long story.")
        partials = _watch_stream(browser, until_texts=2)
        assert len(partials) >= 2, partials
        browser.find_element(By.ID, "stop").click()
        _until(browser, lambda d: not _reply(d)["stop"] and not _reply(d)["streaming"], "the reply stopped")
        stopped_at = _reply(browser)["text"]
        m = _wait_idle(live, timeout=10)  # the server cancelled the generation: nothing runs
        assert _sample(m, "realizar_requests_cancelled") == cancelled0 + 1
        assert backend.decodes - decodes0 < 100
        assert _reply(browser)["text"] == stopped_at  # and the page took no more of it
        assert browser.find_element(By.ID, "tps").text.endswith("· stopped")
        assert browser.find_element(By.ID, "error").text == ""
        assert not browser.find_element(By.ID, "send").get_property("disabled")
    finally:
        backend.delay = 0.0


def test_new_chat_mid_stream_starts_afresh(browser, live):
    from selenium.webdriver.common.by import By

    backend = live.backend
    _open(browser, live)
    _set(browser, "max-tokens", "150")
    cancelled0 = _sample(_wait_idle(live), "realizar_requests_cancelled")
    backend.delay = 0.1
    try:
        _send(browser, "Tell me a long story.")
        _watch_stream(browser, until_texts=1)
        browser.find_element(By.ID, "new-chat").click()
        assert _messages(browser) == []
        assert _sample(_wait_idle(live, timeout=10), "realizar_requests_cancelled") == cancelled0 + 1
    finally:
        backend.delay = 0.0
    _set(browser, "max-tokens", "3")
    _send(browser, "Hi")
    _until(browser, lambda d: len(_messages(d)) == 2 and not _reply(d)["stop"], "the new chat's reply")
    assert live.seen[-1] == [{"role": "user", "content": "Hi"}]  # (no system prompt: none is set)
    assert browser.find_element(By.ID, "tps").text.startswith("3 tokens")
    assert browser.find_element(By.ID, "error").text == ""


ALLOWED_TAGS = {"P", "BR", "STRONG", "EM", "CODE", "PRE", "DIV", "SPAN", "BUTTON", "UL", "OL", "LI", "HR",
                "H1", "H2", "H3", "H4", "H5", "H6"}
HOSTILE = [
    "<script>window.pwned = 1</script>",
    '<img src="x" onerror="window.pwned = 1">',
    "**<img src=x onerror=window.pwned=1>** and *<svg onload=window.pwned=1>*",
    "```<img src=x onerror=window.pwned=1>\n<script>window.pwned = 1</script>\n```",
    "# <iframe src=javascript:window.pwned=1></iframe>",
    "- <a href=javascript:window.pwned=1>x</a>\n1. <style>*{}</style>",
    "`</code><script>window.pwned = 1</script>`",
    "[click](javascript:window.pwned=1) ![x](x\" onerror=\"window.pwned=1)",
    "\" onmouseover=\"window.pwned=1\" x=\"",
]


def _render(driver, text: str) -> dict:
    """What renderMarkdown makes of ``text``: its elements (tag, attributes, text) and its whole text, read from
    an inert <template> (nothing in it runs or loads)."""
    return _js(driver, """
        const t = document.createElement('template');
        t.innerHTML = renderMarkdown(arguments[0]);
        const els = [...t.content.querySelectorAll('*')];
        return {elements: els.map(e => [e.tagName, [...e.attributes].map(a => a.name), e.textContent]),
                text: t.content.textContent};""", text)


def test_markdown_renders_and_model_html_stays_text(browser, live):
    _open(browser, live)
    out = _render(browser, "# Title\n\n**bold**, *it* and `x<y>`\n\n- a\n- b\n\n3. three\n\n"
                           "```python\nprint('<b>hi</b>')\n```")
    tags = [(tag, text) for tag, _, text in out["elements"]]
    for want in [("H1", "Title"), ("STRONG", "bold"), ("EM", "it"), ("CODE", "x<y>"), ("LI", "a"), ("LI", "b"),
                 ("LI", "three"), ("SPAN", "python"), ("CODE", "print('<b>hi</b>')")]:
        assert want in tags, (want, tags)
    assert [a for tag, a, _ in out["elements"] if tag == "OL"] == [["start"]]
    assert "B" not in {tag for tag, _ in tags}

    for text in HOSTILE:
        out = _render(browser, text)
        for tag, attributes, _ in out["elements"]:
            assert tag in ALLOWED_TAGS and set(attributes) <= {"class", "type", "start"}, (text, tag, attributes)
        for piece in re.findall(r"<[a-z]+", text):
            assert piece in out["text"], (text, out["text"])  # shown as text
    assert _js(browser, "return window.pwned") is None


def test_a_reply_full_of_html_is_shown_as_text(browser, live):
    """The whole path (stream, page, renderer) on a reply the test writes: the page's fetch answers it."""
    from selenium.webdriver.common.by import By

    _open(browser, live)
    pieces = ['<img src="x" onerror="window.pwned = 1">', " <script>window.pwned = 1</script>\n\n",
              "```html\n<b>bold?</b>\n", "```\n"]
    _js(browser, """const pieces = arguments[0], fetch0 = window.fetch;
        window.fetch = (url, init) => {
          if (!String(url).endsWith('chat/completions')) return fetch0(url, init);
          const chunk = (content) => 'data: ' + JSON.stringify({choices: [{index: 0, delta: {content},
                                                                            finish_reason: null}]}) + '\\n\\n';
          const body = pieces.map(chunk).join('') + 'data: [DONE]\\n\\n';
          return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
        };""", pieces)
    _send(browser, "Say something dangerous.")
    _until(browser, lambda d: _reply(d)["text"] and not _reply(d)["stop"], "the reply")
    reply = browser.find_element(By.CSS_SELECTOR, "#messages .message.assistant")
    assert reply.find_elements(By.CSS_SELECTOR, "img, script, b") == []
    assert '<img src="x" onerror="window.pwned = 1">' in reply.text and "<script>" in reply.text
    assert reply.find_element(By.CSS_SELECTOR, ".code .lang").text == "html"
    assert reply.find_element(By.CSS_SELECTOR, ".code pre code").text == "<b>bold?</b>"
    assert _js(browser, "return window.pwned") is None
