"""The chat page at `/`: served to browsers (plain text to everyone else), and driven in Debian's chromium
through Playwright: pick a model, stream an answer, stop a long one, switch models, keep the conversation
across a reload, and render a model's markup as text.

Playwright's sync API runs in a worker thread while the server serves on the test's event loop. Screenshots
go to $CORRAL_ARTIFACTS (default /tmp/corral-artifacts), which CI keeps.
"""

import concurrent.futures
import functools
import json
import os
import pathlib
import shutil

import httpx
import pytest
import trio
from conftest import CHATML, TINY_GEMMA3, TINY_LLAMA, _serve, copy_store

pytestmark = pytest.mark.slow  # a browser and a server: out of the fast subset (-m "not slow")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium; .ci/run installs it when missing)"
)
ARTIFACTS = pathlib.Path(os.environ.get("CORRAL_ARTIFACTS", "/tmp/corral-artifacts"))
TINY_THINKER = "tiny-thinker:latest"
# DeepSeek R1's convention: the generation prompt opens the thinking block, so all a random model writes is thinking.
THINKING_CHATML = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
MARKDOWN = "# Title\n\nSome *text*.\n\n- one\n- two\n\n```py\nx = 1 < 2\n```\n\n[docs](https://example.com/a)"
HOSTILE = '<img src=x onerror="window.pwned=1"> **bold** [click](javascript:window.pwned=2) `<b>code</b>`'
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def page_store_root(tiny_store_root, tmp_path_factory) -> pathlib.Path:
    """The tiny store plus a tiny model whose template thinks."""
    from corral.modelfile import ModelSpec, create_model
    from corral.store import Store

    store = Store(copy_store(tiny_store_root, tmp_path_factory.mktemp("page-store") / "models"))
    create_model(store, TINY_THINKER, ModelSpec(from_model=TINY_LLAMA, template=THINKING_CHATML))
    return store.root


@pytest.fixture
async def page_server(page_store_root, tmp_path, nursery):
    yield await _serve(copy_store(page_store_root, tmp_path / "models"), nursery)


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for the module, owned by one thread: Playwright's sync objects stay on the thread
    that made them, so every test's script runs on it too (`in_browser`). Each test gets a fresh context."""
    from playwright.sync_api import sync_playwright

    owner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="playwright")

    def launch():
        playwright = sync_playwright().start()
        # --no-sandbox: CI runs as root, where chromium refuses its sandbox.
        return playwright, playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])

    playwright, chromium = owner.submit(launch).result()
    yield owner, chromium
    owner.submit(lambda: (chromium.close(), playwright.stop())).result()
    owner.shutdown()


def browse(chromium, url: str, script, screenshot: str | None):
    """Run `script(page)` on a fresh page (its own context: no storage shared) opened at `url`; blocking."""
    # bypass_csp: the test's own probes (wait_for_function) are evaluated strings, which the page's policy
    # forbids; the page's scripts run as they would anyway, and the markup test then checks the renderer
    # itself, without the policy's help.
    context = chromium.new_context(viewport={"width": 1200, "height": 800}, bypass_csp=True)
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(url)
        result = script(page)
        if screenshot:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / screenshot), full_page=True)
        assert not errors, errors
        return result
    finally:
        context.close()


async def in_browser(browser, url: str, script, screenshot: str | None = None):
    """`browse` on the browser's own thread, while the server keeps serving on this event loop."""
    owner, chromium = browser
    job = functools.partial(browse, chromium, url, script, screenshot)
    return await trio.to_thread.run_sync(lambda: owner.submit(job).result())


def pick(page, model: str) -> None:
    page.wait_for_selector(f'#model option[value="{model}"]', state="attached")
    page.select_option("#model", model)
    # until the page has applied this model's capabilities (an earlier pick's may still be showing)
    page.wait_for_function("name => document.querySelector('#model').dataset.shown === name", arg=model)


def ask(page, text: str) -> None:
    page.wait_for_function("!document.querySelector('#send').disabled")
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page):
    return page.locator("article.message.assistant").last


def wait_done(page) -> None:
    page.wait_for_function("document.querySelectorAll('article.assistant').length > 0 && "
                           "document.querySelector('article.assistant:last-of-type').dataset.done === 'true'")


# --- served without a browser ---------------------------------------------------------------------


async def test_root_is_the_page_for_browsers_and_text_for_curl(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server) as http:
        page = await http.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
        plain = await http.get("/", headers={"Accept": "*/*"})
    assert page.headers["content-type"].startswith("text/html") and 'id="conversation"' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert plain.headers["content-type"].startswith("text/plain") and plain.text == "corral is running"


async def test_page_files_are_served_and_nothing_else(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server) as http:
        script = await http.get("/ui/chat.js")
        missing = await http.get("/ui/..%2Fpage.py")
        absent = await http.get("/ui/index.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert missing.status_code == 404 and absent.status_code == 404
    assert "error" in absent.json()


# --- in chromium ----------------------------------------------------------------------------------


@needs_chromium
async def test_chat_streams_an_answer_stops_a_long_one_and_switches_models(page_server, browser):
    def script(page):
        pick(page, TINY_LLAMA)
        page.fill("#temperature", "1")  # greedy, the random model writes only newlines: sampled, it writes text
        page.fill("#num_predict", "12")
        ask(page, "Hello there")
        wait_done(page)
        first = last_answer(page)
        streamed = {"chunks": int(first.get_attribute("data-chunks")), "text": first.locator(".content").text_content(),
                    "stats": first.locator(".stats").inner_text(), "who": first.locator(".who").inner_text()}

        page.fill("#num_predict", "-1")  # no limit: it runs until stopped (the context shifts)
        page.fill("#temperature", "0")  # greedy newlines: never the end-of-text token
        ask(page, "Tell me a very long story")
        page.wait_for_function("Number(document.querySelector('article.assistant:last-of-type').dataset.chunks || 0) > 5")
        page.click("#stop")
        wait_done(page)
        stopped = last_answer(page).locator(".stats").inner_text()

        pick(page, TINY_GEMMA3)
        page.fill("#num_predict", "6")
        ask(page, "And you?")
        wait_done(page)
        switched = {"who": last_answer(page).locator(".who").inner_text(), "stats": last_answer(page).locator(".stats").inner_text()}
        return streamed, stopped, switched

    streamed, stopped, switched = await in_browser(browser, page_server, script, screenshot="chat-page.png")
    # Sampled from random weights with no seed, the text may be only spaces or control characters: it is there.
    assert streamed["chunks"] > 2 and streamed["text"], streamed
    assert streamed["who"] == TINY_LLAMA
    assert "tokens/s" in streamed["stats"] and "first token" in streamed["stats"] and "12 tokens" in streamed["stats"]
    assert "stopped" in stopped
    assert switched["who"] == TINY_GEMMA3 and "6 tokens" in switched["stats"], switched
    async with httpx.AsyncClient(base_url=page_server) as http:
        running = {model["name"] for model in (await http.get("/api/ps")).json()["models"]}
        metrics = (await http.get("/metrics")).text
    assert TINY_GEMMA3 in running
    # The stopped answer had no token limit: had stopping not ended it on the server, it would still run.
    assert "\ncorral_running_sequences 0.0\n" in metrics


@needs_chromium
async def test_conversation_survives_a_reload_renders_markdown_and_model_markup_stays_text(page_server, browser):
    saved = {"messages": [{"role": "user", "content": "<script>window.pwned=3</script>hi"},
                          {"role": "assistant", "content": MARKDOWN, "model": TINY_LLAMA},
                          {"role": "user", "content": "again"},
                          {"role": "assistant", "content": HOSTILE, "model": TINY_LLAMA}],
             "settings": {"model": TINY_LLAMA, "system": "Be brief.", "temperature": 0.3}}

    def script(page):
        # the page has shown its first model, and saved its own state with it, by now
        page.wait_for_function("document.querySelector('#model').dataset.shown !== undefined")
        page.evaluate("saved => localStorage.setItem('corral.chat', JSON.stringify(saved))", saved)
        page.reload()
        page.wait_for_selector("article.assistant")
        answer = last_answer(page)
        rendered = page.locator("article.assistant").first
        markdown = {
            "h1": rendered.locator("h1").inner_text(), "em": rendered.locator("em").inner_text(),
            "items": rendered.locator("ul li").all_inner_texts(), "code": rendered.locator("pre code").inner_text(),
            "language": rendered.locator("pre code").get_attribute("data-language"),
            "href": rendered.locator("a").get_attribute("href"), "rel": rendered.locator("a").get_attribute("rel"),
        }
        return {
            "markdown": markdown,
            "pwned": page.evaluate("window.pwned === undefined ? null : window.pwned"),
            "images": page.locator("#conversation img").count(),
            "bold": answer.locator("strong").inner_text(),
            "code": answer.locator("code").inner_text(),
            "links": answer.locator("a").count(),
            "text": answer.locator(".content").inner_text(),
            "user": page.locator("article.user .content").first.inner_text(),
            "system": page.input_value("#system"),
            "temperature": page.input_value("#temperature"),
        }

    seen = await in_browser(browser, page_server, script)
    assert seen["markdown"] == {"h1": "Title", "em": "text", "items": ["one", "two"], "code": "x = 1 < 2", "language": "py",
                                "href": "https://example.com/a", "rel": "noopener noreferrer"}
    assert seen["pwned"] is None and seen["images"] == 0 and seen["links"] == 0
    assert seen["bold"] == "bold" and seen["code"] == "<b>code</b>"
    assert '<img src=x onerror="window.pwned=1">' in seen["text"] and "[click](javascript:" in seen["text"]
    assert seen["user"] == "<script>window.pwned=3</script>hi"
    assert seen["system"] == "Be brief." and seen["temperature"] == "0.3"


@needs_chromium
async def test_json_and_thinking_toggles_follow_the_models_capabilities(page_server, browser):
    def script(page):
        bodies = []
        page.on("request", lambda request: bodies.append(json.loads(request.post_data)) if request.url.endswith("/api/chat") else None)
        pick(page, TINY_LLAMA)
        page.wait_for_selector("#json-toggle", state="visible")
        llama_thinks = page.is_visible("#think-toggle")
        pick(page, TINY_THINKER)
        page.wait_for_selector("#think-toggle", state="visible")
        page.check("#think")
        page.fill("#temperature", "1")
        page.fill("#num_predict", "8")
        page.fill("#system", "You are terse.")
        page.fill("#num_ctx", "96")
        ask(page, "Think first")
        wait_done(page)
        thought = last_answer(page).locator(".thinking div").text_content()  # folded away: not rendered text
        page.uncheck("#think")
        page.check("#json")
        ask(page, "Now as JSON")
        wait_done(page)
        return llama_thinks, bodies, thought

    llama_thinks, bodies, thought = await in_browser(browser, page_server, script, screenshot="chat-page-thinking.png")
    assert not llama_thinks
    thinking, as_json = bodies
    assert thinking["think"] is True and "format" not in thinking and thinking["stream"] is True
    assert thinking["options"] == {"temperature": 1, "num_ctx": 96, "num_predict": 8}
    assert thinking["messages"][0] == {"role": "system", "content": "You are terse."}
    # The tiny model's weights are random and the page sends no seed: its thinking is some text, maybe only
    # control characters or spaces, so the check is that the page put it in the thinking fold at all.
    assert thought
    assert as_json["think"] is False and as_json["format"] == "json"
    assert [m["role"] for m in as_json["messages"]] == ["system", "user", "assistant", "user"]


@needs_chromium
@pytest.mark.real_model
async def test_smollm2_answers_in_the_page(server, browser):
    def script(page):
        pick(page, "smollm2:latest")
        page.fill("#temperature", "0")
        page.fill("#num_predict", "24")
        ask(page, "What is the capital of France?")
        wait_done(page)
        return last_answer(page).locator(".content").inner_text()

    assert "Paris" in await in_browser(browser, server, script, screenshot="chat-page-smollm2.png")
