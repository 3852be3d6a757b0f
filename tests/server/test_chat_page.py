"""The chat page at / in headless Chromium, used as a person would: type, send, watch the answer stream and the
server panel move, stop it. Needs Debian's chromium (`make test` installs it where it can)."""

from __future__ import annotations

import shutil
import signal
from html.parser import HTMLParser

import httpx
import pytest

from tests.server import remote_references
from tests.server.server_harness import BASE_ARGS, GEMMA_CHAT, start_server, stop_with

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


KEY = "page-key"


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium) and could not be installed by make test")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--headless=new"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(server, browser):
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.goto(server.url + "/")
    return page


@pytest.fixture(scope="module")
def base_server(tmp_path_factory):
    """The embedded base model as `make serve` runs it (no --chat-template), behind an API key."""
    server = start_server([*BASE_ARGS, "--served-model-name", "base"], tmp_path_factory.mktemp("base"), api_key=KEY)
    yield server
    stop_with(server, signal.SIGINT)


class _Assets(HTMLParser):
    """The page's own scripts and stylesheets: <script src> and <link rel=stylesheet href>."""

    def __init__(self):
        super().__init__()
        self.paths: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.paths.append(attrs["src"])
        elif tag == "link" and attrs.get("rel") == "stylesheet":
            self.paths.append(attrs["href"])


def test_the_page_and_its_files_are_served_without_a_cdn(http):
    html = http.get("/").text
    assert "<textarea id=\"prompt\"" in html
    assert remote_references.in_html(html) == []
    assets = _Assets()
    assets.feed(html)
    assert sorted(assets.paths) == ["/static/chat.css", "/static/chat.js"]  # what it loads: all from this server
    for path in assets.paths:
        response = http.get(path)
        check = remote_references.in_js if path.endswith(".js") else remote_references.in_css
        assert response.status_code == 200 and check(response.text) == [], path


# Each of these loads something from another host; the check must name it. One line of each page, script or
# stylesheet is remote, so each case proves one way of reaching out is seen.
REMOTE_HTML = [
    '<script src="https://cdn.example.com/marked.js"></script>',
    "<script src='//cdn.example.com/marked.js'></script>",
    '<link rel="stylesheet" href="http://fonts.example.com/css">',
    '<img srcset="/a.png 1x, //cdn.example.com/b.png 2x">',
    '<div style="background: url(//cdn.example.com/x.png)"></div>',
    '<script type="module">import {marked} from "https://esm.example.com/marked";</script>',
    "<style>@import url('https://fonts.example.com/css');</style>",
    '<button onclick="fetch(\'//api.example.com/x\')">x</button>',
    '<meta http-equiv="refresh" content="0; url=//example.com/">',
]
REMOTE_JS = [
    'import {marked} from "https://cdn.example.com/marked.esm.js";',
    "const lib = await import('//cdn.example.com/lib.js');",
    "fetch(`https://api.example.com/v1/${path}`);",
    'script.src = "https:\\/\\/cdn.example.com/x.js";  // escaped slashes',
    "importScripts('http://cdn.example.com/worker.js');",
    "el.style.background = 'url(//cdn.example.com/x.png)';",
    "const socket = new WebSocket('wss://example.com/stream');",
]
REMOTE_CSS = [
    '@import "https://fonts.example.com/css";',
    "@import url(//fonts.example.com/css);",
    "body { background: url('http://cdn.example.com/bg.png'); }",
    "@font-face { font-family: x; src: url(https://fonts.example.com/x.woff2) format('woff2'); }",
]
# ... and these are local: a comment, a path on this server, a string that merely holds slashes.
LOCAL_JS = ['"use strict"; // see https://example.com/docs for the format', "fetch('/v1/models');",
            "/* https://example.com */ const a = 'a // b';", "const parts = line.split(/\\/\\//);"]
LOCAL_CSS = ["/* from https://example.com */ body { background: url(/static/bg.png); }", "a { content: '//'; }"]


@pytest.mark.parametrize("check, source", [
    *[(remote_references.in_html, source) for source in REMOTE_HTML],
    *[(remote_references.in_js, source) for source in REMOTE_JS],
    *[(remote_references.in_css, source) for source in REMOTE_CSS],
])
def test_the_check_finds_a_remote_reference(check, source):
    assert check(source) != [], source


@pytest.mark.parametrize("check, source", [
    *[(remote_references.in_js, source) for source in LOCAL_JS],
    *[(remote_references.in_css, source) for source in LOCAL_CSS],
    (remote_references.in_html, '<svg xmlns="http://www.w3.org/2000/svg"></svg><a href="/static/x">x</a>'),
])
def test_the_check_lets_local_references_and_comments_through(check, source):
    assert check(source) == [], source


def test_the_check_finds_a_cdn_added_to_the_real_files(http):
    """The served page, script and stylesheet with one remote line added are refused (they pass untouched)."""
    html, js, css = (http.get(path).text for path in ("/", "/static/chat.js", "/static/chat.css"))
    cdn_script = '<script src="https://cdn.example.com/marked.js"></script>'
    assert remote_references.in_html(html.replace("</head>", cdn_script + "</head>")) != []
    assert remote_references.in_js(js + '\nimport("https://cdn.example.com/marked.js");\n') != []
    assert remote_references.in_css("@import url(//fonts.example.com/css);\n" + css) != []


def test_type_send_stream_watch_the_panel_and_stop(page):
    page.wait_for_function("document.getElementById('model').textContent === 'gemma-3-270m'")
    page.fill("#system", "You answer briefly.")
    page.fill("#max-tokens", "200")
    page.fill("#prompt", "Tell me a long story about a lighthouse keeper.")
    page.click("#send")
    assert page.is_enabled("#stop") and not page.is_enabled("#send")
    assert page.text_content(".message.user") == "Tell me a long story about a lighthouse keeper."
    # the answer streams: the bubble grows while the request is still running
    page.wait_for_function("document.querySelector('.message.assistant').textContent.length > 0", timeout=60000)
    first = len(page.text_content(".message.assistant"))
    page.wait_for_function(f"document.querySelector('.message.assistant').textContent.length > {first}",
                           timeout=60000)
    # the panel moves: one request running, tokens per second measured
    page.wait_for_function("document.getElementById('running').textContent === '1'", timeout=10000)
    page.wait_for_function("Number(document.getElementById('tps').textContent) > 0", timeout=10000)
    assert page.text_content("#kv").endswith("%")
    page.click("#stop")
    page.wait_for_function("document.querySelector('.message.assistant .note') !== null", timeout=10000)
    assert page.text_content(".message.assistant .note") == "(stopped)"
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    page.wait_for_function("document.getElementById('running').textContent === '0'", timeout=10000)  # aborted
    # the conversation goes on: a second message gets its own answer, ended by max tokens
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "And then?")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelectorAll('.message.assistant .note').length === 2", timeout=60000)
    assert page.text_content(".message.assistant >> nth=1").endswith("(max tokens reached)")


@pytest.fixture(scope="module")
def keyed_chat_server(tmp_path_factory):
    server = start_server([*BASE_ARGS, *GEMMA_CHAT, "--served-model-name", "chat"], tmp_path_factory.mktemp("keyed"),
                          api_key=KEY)
    yield server
    stop_with(server, signal.SIGINT)


def test_with_a_key_the_page_asks_for_it_then_chats(keyed_chat_server, browser):
    context = browser.new_context()
    page = context.new_page()
    page.goto(keyed_chat_server.url + "/")
    page.wait_for_selector("#key-form", state="visible", timeout=30000)
    page.fill("#api-key", "wrong")  # a wrong key is asked for again
    page.click("#key-form button")
    page.wait_for_selector("#key-form", state="visible", timeout=30000)
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    page.wait_for_function("document.getElementById('model').textContent === 'chat'", timeout=30000)
    assert page.is_hidden("#mode-note")  # a chat template: chat mode
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Hello!")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant .note') !== null", timeout=60000)
    assert page.text_content(".message.assistant").endswith("(max tokens reached)")
    assert page.query_selector(".message.error") is None
    context.close()


def test_with_a_key_and_no_chat_template_the_page_asks_once_then_continues_text(base_server, browser):
    context = browser.new_context()
    page = context.new_page()
    page.goto(base_server.url + "/")  # the page itself needs no key
    page.wait_for_selector("#key-form", state="visible", timeout=30000)
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    page.wait_for_function("document.getElementById('model').textContent === 'base'", timeout=30000)
    assert page.is_hidden("#key-form") and "--chat-template" in page.text_content("#mode-note")
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "The capital of France is")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant .note') !== null", timeout=60000)
    assert page.text_content(".message.assistant").endswith("(max tokens reached)")
    assert page.query_selector(".message.error") is None  # answered by /v1/completions, not refused by chat
    page.wait_for_function("Number(document.getElementById('tps').textContent) >= 0", timeout=10000)  # metrics too
    page.reload()  # the key is remembered by this browser: not asked again
    page.wait_for_function("document.getElementById('model').textContent === 'base'", timeout=30000)
    assert page.is_hidden("#key-form")
    context.close()


def test_chat_without_a_template_is_a_400_naming_chat_template(base_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    user = [{"role": "user", "content": "Hi"}]
    for path, body in (("/v1/chat/completions", {"messages": user}), ("/v1/responses", {"input": "Hi"}),
                       ("/v1/messages", {"messages": user, "max_tokens": 4}), ("/tokenize", {"messages": user})):
        answer = httpx.post(base_server.url + path, json=body, headers=headers, timeout=60)
        error = answer.json()["error"]
        field = "input" if path == "/v1/responses" else "messages"  # each API names its own field
        assert answer.status_code == 400 and error["param"] == field, (path, answer.text)
        assert "no chat template" in error["message"] and "--chat-template" in error["message"], path
    assert httpx.get(base_server.url + "/props", headers=headers).json()["chat_template"] == ""
    completion = httpx.post(base_server.url + "/v1/completions", headers=headers, timeout=60,
                            json={"prompt": "Hi", "max_tokens": 2})
    assert completion.status_code == 200  # text completion is what a base model is for
