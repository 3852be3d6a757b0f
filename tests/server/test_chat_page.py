"""The chat page at / in headless Chromium, used as a person would: type, send, watch the answer stream and the
server panel move, stop it. Needs Debian's chromium (`make test` installs it where it can)."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page(server):
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium) and could not be installed by make test")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--headless=new"])
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        page.goto(server.url + "/")
        yield page
        browser.close()


def test_the_page_and_its_files_are_served_without_a_cdn(http):
    html = http.get("/").text
    assert "<textarea id=\"prompt\"" in html and "https://" not in html and "http://" not in html
    for path in ("/static/chat.js", "/static/chat.css"):
        response = http.get(path)
        assert response.status_code == 200 and "http" not in response.text.replace("https://", "").split("//")[0]


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
