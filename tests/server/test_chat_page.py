"""The chat page at / in headless Chromium, used as a person would: type, send, watch the answer stream and the
server panel move, stop it. Needs Debian's chromium (`make test` installs it where it can)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from tests.server import remote_references
from tests.server.server_harness import BASE_ARGS, GEMMA_CHAT, start_server, stop_with

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
VENDOR = Path(__file__).parents[2] / "pagellm" / "server" / "static" / "vendor"


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


OWN_ASSETS = ["/static/chat.css", "/static/chat.js", "/static/render.js"]
# The URL-like strings inside the vendored libraries, none of them ever fetched: XML namespace names (DOMPurify),
# links in error messages, the scheme marked's autolinks start with, a keyword pattern of a highlighted language.
# Pinned per file, so that a new one after an update is looked at before it is added here.
VENDORED = {
    "/static/vendor/highlight-github.min.css": [],
    "/static/vendor/highlight.min.js": ["https://github.com/highlightjs/highlight.js/wiki/security",
                                        r"//|\\{|\\}|endif|gosub|variant|wend|^\\$ "],
    "/static/vendor/marked.umd.js": ["http://", "\nPlease report this to https://github.com/markedjs/marked."],
    "/static/vendor/purify.min.js": ["http://www.w3.org/1998/Math/MathML", "http://www.w3.org/2000/svg",
                                     "http://www.w3.org/1999/xhtml",
                                     '<html xmlns="http://www.w3.org/1999/xhtml"><head></head><body>'],
}


def test_the_page_and_its_files_are_served_without_a_cdn(http):
    html = http.get("/").text
    assert "<textarea id=\"prompt\"" in html
    assert remote_references.in_html(html) == []
    assets = _Assets()
    assets.feed(html)
    assert sorted(assets.paths) == sorted(OWN_ASSETS + list(VENDORED))  # what it loads: all from this server
    for path in assets.paths:
        response = http.get(path)
        check = remote_references.in_js if path.endswith(".js") else remote_references.in_css
        assert response.status_code == 200 and check(response.text) == VENDORED.get(path, []), path


def test_the_vendored_files_are_the_ones_their_readme_pins_with_their_licences():
    readme = (VENDOR / "README.md").read_text()
    pinned = dict((name, sha) for sha, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M))
    served = {path.removeprefix("/static/vendor/") for path in VENDORED}
    assert set(pinned) == served
    for name, sha in pinned.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == sha, name
    for licence in ("marked.LICENSE", "dompurify.LICENSE", "highlight.LICENSE"):
        assert (VENDOR / licence).stat().st_size > 500 and licence in readme, licence


def test_the_favicon_is_served(http):
    response = http.get("/favicon.ico")
    assert response.status_code == 200 and response.headers["content-type"].startswith("image/svg+xml")
    assert response.content.lstrip().startswith(b"<svg")


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


def test_with_a_key_the_page_and_its_files_open_without_one(keyed_chat_server):
    """The page's files hold no data; the page asks for the key only for the API's calls."""
    for path in ["/", "/favicon.ico", *OWN_ASSETS, *VENDORED]:
        assert httpx.get(keyed_chat_server.url + path, timeout=30).status_code == 200, path
    assert httpx.get(keyed_chat_server.url + "/v1/models", timeout=30).status_code == 401


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
    assert page.is_hidden("#mode-note") and page.is_visible("#system")  # a chat template: chat mode
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
    assert page.is_hidden("#system") and page.is_visible("#temperature")  # text mode: no system prompt to set
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "The capital of France is")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant .note') !== null", timeout=60000)
    assert page.text_content(".message.assistant").endswith("(max tokens reached)")
    assert page.query_selector(".message.error") is None  # answered by /v1/completions, not refused by chat
    assert page.query_selector(".message.assistant .markdown") is None  # a continuation is text, not Markdown
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


# Answers of our choosing: the page's streaming chat request is answered by the browser itself, in the shape of
# OpenAI's chat.completion.chunk events that chat.js reads, one event per piece.
def sse_answer(*pieces: str, finish: str = "stop") -> str:
    def event(delta, finish_reason=None):
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        chunk = {"id": "chatcmpl-page", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [choice]}
        return f"data: {json.dumps(chunk)}\n\n"

    return "".join(event({"content": piece}) for piece in pieces) + event({}, finish) + "data: [DONE]\n\n"


@pytest.fixture
def answering(server, browser):
    """A fresh page in chat mode whose next answer is ask(...)'s pieces; the URLs it requested are kept."""
    context = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.requested = []
    page.on("request", lambda request: page.requested.append(request.url))
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'gemma-3-270m'", timeout=30000)

    def ask(*pieces: str):
        body = sse_answer(*pieces)
        page.route("**/v1/chat/completions", lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=body))
        page.fill("#prompt", "Write a function.")
        page.press("#prompt", "Enter")
        page.wait_for_function("!document.getElementById('send').disabled", timeout=10000)  # the answer ended
        return page.locator(".message.assistant").last

    yield page, ask
    context.close()


CODE = "def add(a, b):\n    return a + b\n"


def test_a_markdown_answer_renders_highlighted_code_with_a_copy_button(answering, server):
    page, ask = answering
    message = ask("Here is **the** function:\n\n```py", "thon\n", CODE[:9], CODE[9:], "```\n\n- one\n- two\n",
                  "![tracker](https://example.com/pixel.png?chat=secret)")
    code = message.locator("pre code")
    assert code.count() == 1 and code.text_content() == CODE.rstrip("\n")
    assert set(code.get_attribute("class").split()) == {"hljs", "language-python"}
    assert message.locator("pre code .hljs-keyword").first.text_content() == "def"
    assert "monospace" in code.evaluate("element => getComputedStyle(element).fontFamily")
    assert message.locator("strong").text_content() == "the" and message.locator("li").count() == 2
    assert page.locator(".message.user").text_content() == "Write a function."
    assert message.locator("img").count() == 0  # an image in an answer is a link, never fetched
    assert all(url.startswith(server.url) for url in page.requested), page.requested
    button = message.locator(".code-block button.copy")
    assert button.text_content() == "Copy" and message.locator(".code-bar").text_content().startswith("python")
    button.click()
    page.wait_for_function("document.querySelector('button.copy').textContent === 'Copied'", timeout=5000)
    assert page.evaluate("navigator.clipboard.readText()") == CODE.rstrip("\n")


def test_html_and_script_in_an_answer_never_run(answering):
    page, ask = answering
    message = ask("<scr", "ipt>window.pwned = 1</script> and <img src=x onerror=\"window.pwned = 2\">\n\n",
                  '<div onmouseover="window.pwned = 3">hover</div>\n\n[a link](javascript:window.pwned=4)\n')
    page.wait_for_timeout(200)  # time for an error event of an image, had one been made
    assert page.evaluate("window.pwned") is None
    assert message.locator("script, img, div[onmouseover]").count() == 0
    assert "<script>window.pwned = 1</script>" in message.text_content()  # shown as the model wrote it
    link = message.locator("a")
    assert link.text_content() == "a link" and not (link.get_attribute("href") or "").startswith("javascript")
    link.click()  # the sanitizer, not only marked's escaping, kept the javascript: URL out
    assert page.evaluate("window.pwned") is None


def test_a_streamed_answer_keeps_its_finished_blocks_and_renders_an_open_fence(answering):
    page, _ = answering
    # render.js's view, driven chunk by chunk as chat.js drives it, one animation frame per chunk
    rendered = page.evaluate("""async () => {
        const element = document.createElement("div");
        document.getElementById("transcript").appendChild(element);
        const view = new AnswerView(element, true);
        const frame = () => new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve)));
        view.update("First paragraph.\\n\\n```python\\ndef f(");
        await frame();
        const first = element.querySelector("p"), open = element.querySelector("pre code");
        const during = {code: open && open.textContent, cls: open && open.className, paragraphs: 1};
        view.update("First paragraph.\\n\\n```python\\ndef f(x):\\n    return x\\n```\\nAfter.");
        await frame();
        view.finish("First paragraph.\\n\\n```python\\ndef f(x):\\n    return x\\n```\\nAfter.");
        return {during, kept: element.querySelector("p") === first, blocks: element.children.length,
                code: element.querySelector("pre code").textContent, last: element.lastChild.textContent.trim()};
    }""")
    assert rendered["during"]["code"] == "def f(" and "language-python" in rendered["during"]["cls"]
    assert rendered["kept"]  # the finished paragraph is the same element: not rebuilt, no flicker
    assert rendered["blocks"] == 3 and rendered["code"] == "def f(x):\n    return x" and rendered["last"] == "After."
