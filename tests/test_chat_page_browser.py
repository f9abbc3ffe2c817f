"""The chat page in a real browser: headless chromium driven by selenium against ``mmserve
serve`` on the bundled demo model (float32, behind an API key), in a subprocess on a loopback
port.

The page asks for the key, attaches a sample scene through its file input, sends a question with
Enter and streams the answer, which must equal ``LLM.generate``'s greedy answer to the same
conversation (and so must a follow-up turn). A file that is no image shows the server's 400
message; the stop button ends a streaming answer; at a phone's size nothing scrolls sideways and
the input stays on screen. Screenshots go to ``$MMSERVE_SCREENSHOT_DIR`` when set.

Needs chromium and its driver (Debian: ``apt-get install chromium chromium-driver``) and
selenium (``pip install -e ".[test]"``); without them the module is skipped with that advice.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mmserve import LLM, SamplingParams
from mmserve.demo.checkpoint import demo_model_path
from tests.test_server import Server, wait_drained

INSTALL = ("install them with `apt-get install chromium chromium-driver` and "
           "`pip install -e \".[test]\"`")
pytest.importorskip("selenium", reason=f"the browser test needs selenium; {INSTALL}")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip(f"the browser test needs chromium and chromedriver; {INSTALL}",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "browser-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCENE = Path(__file__).resolve().parents[1] / "samples" / "scene_02.png"
QUESTION = "What colour is the circle?"
FOLLOW_UP = "Where is the square?"
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("chat-page") / "server.log"
    srv = Server(str(demo_model_path()), "--served-model-name", "demo", log=log,
                 env={"MMSERVE_API_KEY": KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_model_path()), dtype="float32")


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1280,860"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: selenium-manager never runs (it would download a driver).
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    path = Path(os.environ.get("MMSERVE_SCREENSHOT_DIR") or tmp_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------- page helpers
def wait(driver: webdriver.Chrome, timeout: float = TIMEOUT_S) -> WebDriverWait:
    return WebDriverWait(driver, timeout, poll_frequency=0.05)


def open_page(driver: webdriver.Chrome, server: Server) -> None:
    """Load the page in a fresh state, giving the key if it asks, until it names the model."""
    driver.get(f"{server.url}/")
    key_form = driver.find_element(By.ID, "key-form")
    wait(driver).until(lambda d: key_form.is_displayed() or model_name(d) == "demo")
    if key_form.is_displayed():
        give_key(driver, KEY)
    wait(driver).until(lambda d: model_name(d) == "demo")


def model_name(driver: webdriver.Chrome) -> str:
    return driver.find_element(By.ID, "model").text


def give_key(driver: webdriver.Chrome, key: str) -> None:
    field = driver.find_element(By.ID, "key-input")
    field.clear()
    field.send_keys(key, Keys.ENTER)


def attach(driver: webdriver.Chrome, path: Path) -> None:
    before = len(driver.find_elements(By.CSS_SELECTOR, "#attachments .thumb"))
    driver.find_element(By.ID, "file-input").send_keys(str(path))
    wait(driver).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attachments .thumb")) == before + 1)


def ask(driver: webdriver.Chrome, text: str) -> None:
    driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)


def answers(driver: webdriver.Chrome) -> list[WebElement]:
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant[data-state]")


def wait_for_answer(driver: webdriver.Chrome, number: int) -> WebElement:
    """The ``number``-th answer (from 1) once it has stopped streaming."""

    def finished(d: webdriver.Chrome) -> WebElement | bool:
        shown = answers(d)
        if len(shown) < number or shown[number - 1].get_attribute("data-state") == "streaming":
            return False
        return shown[number - 1]

    return wait(driver).until(finished)


def text_of(answer: WebElement) -> str:
    return answer.find_element(By.CSS_SELECTOR, ".text").get_property("textContent")


def assert_no_page_errors(driver: webdriver.Chrome) -> None:
    """No script error or refused load (CSP) in the console; the API's own 4xx answers, which
    the browser logs as failed loads, are expected."""
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"
              and "the server responded with a status of 4" not in e["message"]]
    assert not errors, errors


def greedy(llm: LLM, messages: list[dict[str, Any]], max_tokens: int, **options: Any) -> str:
    out = llm.generate({"messages": messages, "images": [str(SCENE)]},
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, **options))[0]
    return out.text


def question(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


# --------------------------------------------------------------------- tests
def test_page_asks_for_the_api_key(browser: webdriver.Chrome, server: Server) -> None:
    browser.get(f"{server.url}/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    key_form = browser.find_element(By.ID, "key-form")
    wait(browser).until(lambda d: key_form.is_displayed())
    give_key(browser, "wrong")
    error = browser.find_element(By.ID, "key-error")
    wait(browser).until(lambda d: "did not accept" in error.text and key_form.is_displayed())
    give_key(browser, KEY)
    wait(browser).until(lambda d: model_name(d) == "demo" and not key_form.is_displayed())
    assert browser.execute_script("return sessionStorage.getItem('mmserve.apiKey')") == KEY
    # The stats panel polls /stats with the key.
    wait(browser).until(lambda d: d.find_element(By.ID, "stat-kv").text.endswith("%"))
    assert browser.find_element(By.ID, "stat-running").text.isdigit()
    assert browser.find_element(By.ID, "stat-waiting").text.isdigit()
    assert_no_page_errors(browser)


def test_streamed_answers_equal_the_python_api(browser: webdriver.Chrome, server: Server,
                                                llm: LLM, screenshot_dir: Path) -> None:
    open_page(browser, server)
    attach(browser, SCENE)
    assert browser.find_element(By.CSS_SELECTOR, "#attachments .thumb img").get_attribute(
        "alt") == SCENE.name
    ask(browser, QUESTION)
    first = wait_for_answer(browser, 1)
    assert first.get_attribute("data-state") == "done", first.text
    max_tokens = browser.execute_script("return maxTokens()")
    expected = greedy(llm, [question(QUESTION)], max_tokens)
    assert text_of(first) == expected
    meta = first.find_element(By.CSS_SELECTOR, ".meta").text
    assert meta.startswith("first token ") and " ms · " in meta and " token" in meta, meta
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments .thumb")  # sent along

    # Multi-turn: the page sends the whole conversation, image included.
    ask(browser, FOLLOW_UP)
    second = wait_for_answer(browser, 2)
    assert second.get_attribute("data-state") == "done", second.text
    conversation = [question(QUESTION), {"role": "assistant", "content": expected},
                    {"role": "user", "content": [{"type": "text", "text": FOLLOW_UP}]}]
    assert text_of(second) == greedy(llm, conversation, max_tokens)
    wait(browser).until(lambda d: "/" in d.find_element(By.ID, "stat-encoder").text)
    browser.save_screenshot(str(screenshot_dir / "chat_page.png"))
    assert_no_page_errors(browser)
    wait_drained(server.url, AUTH)


def test_a_file_that_is_no_image_shows_the_server_error(
        browser: webdriver.Chrome, server: Server, llm: LLM, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture\n")
    url = f"data:text/plain;base64,{base64.b64encode(notes.read_bytes()).decode()}"
    body = {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]}]}
    refusal = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH)
    assert refusal.status_code == 400

    open_page(browser, server)
    attach(browser, notes)
    tile = browser.find_element(By.CSS_SELECTOR, "#attachments .file-tile")
    assert tile.text == "notes.txt"
    ask(browser, "What?")
    answer = wait_for_answer(browser, 1)
    assert answer.get_attribute("data-state") == "error"
    assert answer.find_element(By.CSS_SELECTOR, ".error").text == refusal.json()["error"][
        "message"]
    # The refused turn is not part of the conversation: the next one is answered alone.
    attach(browser, SCENE)
    ask(browser, QUESTION)
    retry = wait_for_answer(browser, 2)
    max_tokens = browser.execute_script("return maxTokens()")
    assert text_of(retry) == greedy(llm, [question(QUESTION)], max_tokens)
    assert_no_page_errors(browser)


def test_stop_button_ends_the_answer(browser: webdriver.Chrome, server: Server,
                                     llm: LLM) -> None:
    """The demo model answers in a few tokens, so the page's request asks to ignore the end of
    sequence, and the network is slowed so that the answer is still arriving at the click."""
    open_page(browser, server)
    browser.execute_script("""
        const fetchFromServer = window.fetch;
        window.fetch = (url, options) => {
          if (String(url).endsWith("chat/completions")) {
            options = {...options, body: JSON.stringify(
              {...JSON.parse(options.body), ignore_eos: true})};
          }
          return fetchFromServer(url, options);
        };""")
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.emulateNetworkConditions", {
        "offline": False, "latency": 0, "downloadThroughput": 2000, "uploadThroughput": -1})
    try:
        attach(browser, SCENE)
        ask(browser, QUESTION)
        wait(browser).until(lambda d: answers(d) and text_of(answers(d)[0]))
        browser.find_element(By.ID, "stop").click()
        answer = wait_for_answer(browser, 1)
    finally:
        browser.execute_cdp_cmd("Network.emulateNetworkConditions", {
            "offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    assert answer.get_attribute("data-state") == "stopped"
    assert answer.find_element(By.CSS_SELECTOR, ".meta").text.startswith("Stopped")
    # What arrived is the start of the answer (every token of this model makes some text, so
    # one token more than its characters makes a longer text).
    partial = text_of(answer)
    assert partial
    max_tokens = min(len(partial) + 1, browser.execute_script("return maxTokens()"))
    longer = greedy(llm, [question(QUESTION)], max_tokens, ignore_eos=True)
    assert longer.startswith(partial) and len(longer) > len(partial), (partial, longer)
    assert browser.find_element(By.ID, "send").is_displayed()
    assert not browser.find_element(By.ID, "stop").is_displayed()
    wait_drained(server.url, AUTH)


def test_phone_sized_window(browser: webdriver.Chrome, server: Server,
                            screenshot_dir: Path) -> None:
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 375, "height": 740, "deviceScaleFactor": 2, "mobile": True})
    try:
        open_page(browser, server)
        attach(browser, SCENE)
        ask(browser, QUESTION)
        assert wait_for_answer(browser, 1).get_attribute("data-state") == "done"
        assert_fits_the_screen(browser)
        wait(browser).until(lambda d: "/" in d.find_element(By.ID, "stat-encoder").text)
        browser.save_screenshot(str(screenshot_dir / "chat_page_phone.png"))
        # A long word wraps in its bubble instead of widening the page.
        browser.execute_script("showUserMessage('x'.repeat(300), [])")
        assert_fits_the_screen(browser)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert_no_page_errors(browser)


def assert_fits_the_screen(driver: webdriver.Chrome) -> None:
    """No sideways scrolling, nothing sticking out sideways (to be clipped or scrolled inside
    its box), and the message box and the send button on screen."""
    layout = driver.execute_script("""
        const root = document.documentElement;
        const box = (id) => document.getElementById(id).getBoundingClientRect().toJSON();
        const outside = [...document.body.querySelectorAll("*")].filter((node) => {
          const rect = node.getBoundingClientRect();
          if (rect.width === 0 || node.matches(".visually-hidden, .model")) return false;
          return rect.left < -0.5 || rect.right > innerWidth + 0.5
            || node.scrollWidth > node.clientWidth + 1;  // content wider than its box
        }).map((node) => node.outerHTML.slice(0, 80));
        return {scrollWidth: root.scrollWidth, clientWidth: root.clientWidth,
                innerWidth: innerWidth, innerHeight: innerHeight, outside: outside,
                send: box("send"), prompt: box("prompt")};""")
    assert layout["innerWidth"] == 375
    assert layout["scrollWidth"] <= layout["clientWidth"], layout
    assert layout["outside"] == [], layout
    for name in ("send", "prompt"):
        rect = layout[name]
        assert rect["left"] >= 0 and rect["right"] <= layout["innerWidth"], (name, layout)
        assert rect["top"] >= 0 and rect["bottom"] <= layout["innerHeight"], (name, layout)
    assert driver.find_element(By.ID, "send").is_displayed()
