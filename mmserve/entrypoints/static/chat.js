// mmserve chat page: attach images, ask about them, read the answer as it streams.
// Plain JavaScript with no dependencies. Every path is relative, so the page talks only to the
// server that served it, also behind a reverse proxy under a path prefix.
"use strict";

const MAX_TOKENS = 512; // per answer, at most the model's max_model_len (from /v1/models)
const TEMPERATURE = 0; // greedy: the same question about the same image gets the same answer
const STATS_INTERVAL_MS = 2000;
const KEY_STORAGE = "mmserve.apiKey"; // sessionStorage: the key lives as long as the tab

const state = {
  apiKey: sessionStorage.getItem(KEY_STORAGE),
  model: null, // {id, max_model_len, ...} from /v1/models
  modelReady: null, // Promise of loading the model
  history: [], // OpenAI chat messages of the conversation so far
  attachments: [], // {name, type, url}: files going with the next message
  reading: Promise.resolve(), // files still being read
  controller: null, // AbortController of the answer being streamed
  keyPrompt: null, // Promise resolved when the key form is submitted
  hint: null, // the empty conversation's text, shown again by "New chat"
};

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ------------------------------------------------------------------ API calls

/** fetch with the API key; on a 401 asks for the key and tries again. */
async function api(path, options = {}) {
  for (;;) {
    const headers = { ...options.headers };
    if (state.apiKey) headers.Authorization = `Bearer ${state.apiKey}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    await askForKey();
    options.signal?.throwIfAborted();
  }
}

/** The message of OpenAI's error body, or the status line when there is none. */
async function errorMessage(response) {
  const text = await response.text();
  try {
    const message = JSON.parse(text).error?.message;
    if (message) return message;
  } catch {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText} ${text}`.trim();
}

/** Show the key form (once for all callers waiting on it); resolves when it is submitted. */
function askForKey() {
  if (state.keyPrompt) return state.keyPrompt;
  const form = $("key-form");
  $("key-error").textContent = state.apiKey ? "The server did not accept that key." : "";
  form.hidden = false;
  $("key-input").focus();
  state.keyPrompt = new Promise((resolve) => {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      state.apiKey = $("key-input").value.trim();
      sessionStorage.setItem(KEY_STORAGE, state.apiKey);
      form.hidden = true;
      state.keyPrompt = null;
      resolve();
    }, { once: true });
  });
  return state.keyPrompt;
}

async function loadModel() {
  try {
    const response = await api("v1/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    state.model = (await response.json()).data[0];
    $("model").textContent = state.model.id;
    $("model").title = `Model: ${state.model.id} (max_model_len ${state.model.max_model_len})`;
  } catch (error) {
    $("model").textContent = `no model list: ${error.message}`;
  }
}

// ------------------------------------------------------------------ server stats

async function pollStats() {
  try {
    const response = await api("stats");
    if (response.ok) showStats(await response.json());
  } catch {
    // the server is away: keep the last numbers and try again
  }
  setTimeout(pollStats, STATS_INTERVAL_MS);
}

const percent = (fraction) => `${(100 * fraction).toFixed(1)}%`;

function showStats(stats) {
  $("stat-running").textContent = stats.num_running;
  $("stat-waiting").textContent = stats.num_waiting;
  $("stat-kv").textContent = percent(1 - stats.kv_blocks_free / stats.kv_blocks_total);
  const hits = stats.encoder_cache_hits;
  const lookups = hits + stats.encoder_cache_misses;
  $("stat-encoder").textContent = lookups ? `${percent(hits / lookups)} (${hits}/${lookups})` : "–";
}

// ------------------------------------------------------------------ attachments

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

/** Attach files. Anything is sent as picked: the server says which formats it takes. */
function addFiles(files) {
  const reads = Promise.all([...files].map(async (file) => ({
    name: file.name || "pasted image",
    type: file.type,
    url: await readAsDataUrl(file),
  })));
  state.reading = Promise.all([state.reading, reads])
    .then(([, items]) => {
      state.attachments.push(...items);
      renderAttachments();
    })
    .catch((error) => showNotice(`Could not read the file: ${error.message}`));
}

function preview(item) {
  if (!item.type.startsWith("image/")) return el("span", "file-tile", item.name);
  const img = el("img");
  img.src = item.url;
  img.alt = item.name;
  return img;
}

function renderAttachments() {
  $("attachments").replaceChildren(...state.attachments.map((item, index) => {
    const remove = el("button", "remove", "×");
    remove.type = "button";
    remove.setAttribute("aria-label", `Remove ${item.name}`);
    remove.addEventListener("click", () => {
      state.attachments.splice(index, 1);
      renderAttachments();
    });
    const thumb = el("div", "thumb");
    thumb.append(preview(item), remove);
    return thumb;
  }));
}

function imageFiles(dataTransfer) {
  return [...(dataTransfer?.files ?? [])].filter((file) => file.type.startsWith("image/"));
}

// ------------------------------------------------------------------ conversation view

/** Run `change`, then follow the conversation down if the reader was at its end. */
function followConversation(change) {
  const box = $("conversation");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  change();
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function addToConversation(node) {
  $("conversation").querySelector(".hint")?.remove();
  followConversation(() => $("conversation").append(node));
}

function errorBox(text) {
  const box = el("div", "error", text);
  box.setAttribute("role", "alert");
  return box;
}

function showNotice(text) {
  const node = el("div", "message assistant");
  node.append(errorBox(text));
  addToConversation(node);
}

function showUserMessage(text, attachments) {
  const node = el("div", "message user");
  if (attachments.length) {
    const images = el("div", "images");
    images.append(...attachments.map(preview));
    node.append(images);
  }
  if (text) node.append(el("div", "text", text));
  addToConversation(node);
}

/** An empty answer bubble; `data-state` goes from "streaming" to done, stopped or error. */
function showAnswer() {
  const node = el("div", "message assistant");
  node.dataset.state = "streaming";
  const text = el("div", "text");
  const meta = el("div", "meta");
  node.append(text, meta);
  addToConversation(node);
  return {
    node,
    text,
    meta,
    append(chunk) {
      followConversation(() => text.append(chunk));
    },
    finish(stateName, note, error) {
      node.dataset.state = stateName;
      meta.textContent = note;
      if (error) followConversation(() => node.append(errorBox(error)));
    },
  };
}

/** "time to first token · tokens · tokens/s" of a streamed answer. */
function timingNote(timing) {
  const parts = [];
  const first = timing.firstToken ?? timing.finished;
  if (first !== null) parts.push(`first token ${Math.round(first - timing.started)} ms`);
  const tokens = timing.tokens ?? timing.chunks; // usage counts tokens that make no text too
  parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
  // Decode speed: the tokens after the first over the time after the first.
  const seconds = ((timing.finished ?? performance.now()) - first) / 1000;
  if (first !== null && tokens > 1 && seconds > 0) {
    parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
  }
  if (timing.finishReason === "length") parts.push("cut off at the length limit");
  return parts.join(" · ");
}

// ------------------------------------------------------------------ sending

function maxTokens() {
  return Math.min(MAX_TOKENS, state.model?.max_model_len ?? MAX_TOKENS);
}

function requestBody(history) {
  return {
    model: state.model?.id,
    messages: history,
    max_tokens: maxTokens(),
    temperature: TEMPERATURE,
    stream: true,
    stream_options: { include_usage: true },
  };
}

/** The JSON events of a server-sent event stream, up to `[DONE]`. */
async function* serverEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

/** Stream the answer to `history` into `view`, noting times in `timing`. Throws the
 * server's error message, or an AbortError when stopped. */
async function streamAnswer(history, view, signal, timing) {
  const response = await api("v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(requestBody(history)),
    signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  for await (const event of serverEvents(response.body)) {
    if (event.error) throw new Error(event.error.message);
    const choice = event.choices[0];
    if (choice?.delta?.content) {
      timing.firstToken ??= performance.now();
      timing.chunks += 1;
      view.append(choice.delta.content);
    }
    if (choice?.finish_reason) {
      timing.finished = performance.now();
      timing.finishReason = choice.finish_reason;
    }
    if (event.usage) timing.tokens = event.usage.completion_tokens;
  }
  if (timing.finished === null) throw new Error("the connection closed before the answer ended");
}

function setBusy(controller) {
  state.controller = controller;
  $("send").hidden = controller !== null;
  $("stop").hidden = controller === null;
  // Screen readers announce the answer once it is complete, not token by token.
  $("conversation").setAttribute("aria-busy", String(controller !== null));
}

async function send(event) {
  event.preventDefault();
  if (state.controller) return; // one answer at a time
  const controller = new AbortController();
  setBusy(controller);
  try {
    await state.reading;
    const history = takeQuestion();
    if (history) await answer(history, controller.signal);
  } finally {
    setBusy(null);
  }
  $("prompt").focus();
}

/** Move the typed text and the attachments into the conversation, which is returned; null
 * when there is nothing to send. */
function takeQuestion() {
  const prompt = $("prompt");
  const text = prompt.value.trim();
  const attachments = state.attachments;
  if (!text && !attachments.length) return null;
  const content = attachments.map((item) => ({ type: "image_url", image_url: { url: item.url } }));
  if (text) content.push({ type: "text", text });
  const history = state.history; // "New chat" meanwhile starts another array
  history.push({ role: "user", content });
  showUserMessage(text, attachments);
  state.attachments = [];
  renderAttachments();
  prompt.value = "";
  fitPrompt();
  return history;
}

/** Stream the answer to the last question of `history` and add it there. */
async function answer(history, signal) {
  await state.modelReady;
  const view = showAnswer();
  const timing = { started: performance.now(), firstToken: null, finished: null, chunks: 0,
                   tokens: null, finishReason: null };
  try {
    await streamAnswer(history, view, signal, timing);
    view.finish("done", timingNote(timing));
  } catch (error) {
    if (error.name === "AbortError") view.finish("stopped", `Stopped · ${timingNote(timing)}`);
    else view.finish("error", "", error.message);
  }
  // The conversation goes on from what the user saw; a question left unanswered is dropped.
  const text = view.text.textContent;
  if (text) history.push({ role: "assistant", content: text });
  else history.pop();
}

function newChat() {
  state.controller?.abort();
  state.history = [];
  $("conversation").replaceChildren(state.hint.cloneNode(true));
  $("prompt").focus();
}

// ------------------------------------------------------------------ wiring

function fitPrompt() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${prompt.scrollHeight + 2}px`;
}

function onPromptKey(event) {
  // Enter sends, Shift+Enter is a new line; not while an input method composes a character.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
}

function wireDragAndDrop() {
  document.addEventListener("dragover", (event) => {
    if (!event.dataTransfer?.types.includes("Files")) return;
    event.preventDefault();
    document.body.classList.add("dragging");
  });
  document.addEventListener("dragleave", (event) => {
    if (event.relatedTarget === null) document.body.classList.remove("dragging");
  });
  document.addEventListener("drop", (event) => {
    event.preventDefault();
    document.body.classList.remove("dragging");
    if (event.dataTransfer?.files.length) addFiles(event.dataTransfer.files);
  });
}

function main() {
  state.hint = $("conversation").querySelector(".hint").cloneNode(true);
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", newChat);
  $("prompt").addEventListener("keydown", onPromptKey);
  $("prompt").addEventListener("input", fitPrompt);
  $("file-input").addEventListener("change", (event) => {
    addFiles(event.target.files);
    event.target.value = ""; // picking the same file again is a change too
  });
  document.addEventListener("paste", (event) => {
    const images = imageFiles(event.clipboardData);
    if (!images.length) return; // plain text pastes as usual
    event.preventDefault();
    addFiles(images);
  });
  wireDragAndDrop();
  state.modelReady = loadModel();
  pollStats();
}

main(); // the script is deferred: the document is parsed
