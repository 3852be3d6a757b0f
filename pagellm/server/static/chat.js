// The chat page: streams /v1/chat/completions with fetch (or /v1/completions for a model with no chat template),
// and polls /metrics for the server panel; render.js shows the answers as Markdown. No framework and no build step:
// this file is served as it is (pagellm/server/static). The page itself needs no key; a server with --api-key
// answers its calls 401, and the page then asks for the key once, keeps it in this browser's storage and sends it
// with every call.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pagellm-api-key";
const history = [];  // {role, content} of the conversation so far
let controller = null;  // AbortController of the answer being streamed
let modelName = null;
let textMode = false;  // the model has no chat template: continue the text instead
let keyAsked = null;  // the pending question for a key, shared by every call that got a 401

function askForKey() {
  if (!keyAsked) {
    $("key-form").hidden = false;
    $("api-key").focus();
    keyAsked = new Promise((resolve) => {
      $("key-form").addEventListener("submit", (event) => {
        event.preventDefault();
        localStorage.setItem(KEY_STORE, $("api-key").value.trim());
        $("key-form").hidden = true;
        keyAsked = null;
        resolve();
      }, {once: true});
    });
  }
  return keyAsked;
}

// fetch with the stored key; a 401 asks for the key (again, when the stored one is wrong) and retries
async function api(path, options = {}) {
  for (;;) {
    const key = localStorage.getItem(KEY_STORE);
    const headers = {...(options.headers || {}), ...(key ? {Authorization: `Bearer ${key}`} : {})};
    const response = await fetch(path, {...options, headers});
    if (response.status !== 401) return response;
    await askForKey();
  }
}

async function loadModel() {
  try {
    const body = await (await api("/v1/models")).json();
    let response = await api("/props");
    while (response.status === 503) {  // the model still loads: its template is not known yet
      await new Promise((resolve) => setTimeout(resolve, 1000));
      response = await api("/props");
    }
    const props = await response.json();
    modelName = body.data[0].id;
    textMode = !props.chat_template;
    $("model").textContent = modelName;  // last: once it shows, the page knows its mode
    if (textMode) {
      $("mode-note").hidden = false;
      $("mode-note").textContent = "This model has no chat template (a base model continues text rather than "
        + "answering), so this page continues your text with /v1/completions. Serve it with --chat-template "
        + "to chat with it.";
      $("prompt").placeholder = "Text for the model to continue (Enter sends)";
      $("system-setting").hidden = true;  // a continuation has no system prompt: the box would do nothing
    }
  } catch (error) {
    $("model").textContent = "model unavailable";
  }
}

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  element.textContent = text;
  $("transcript").appendChild(element);
  element.scrollIntoView({block: "end"});
  return element;
}

// render.js did not load (a proxy in front of the server refused its files): answers as plain text still
function plainView(element) {
  const show = (text) => { element.textContent = text; element.scrollIntoView({block: "end"}); };
  return {update: show, finish: show, stop() {}};
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function requestBody() {
  const settings = {
    model: modelName, stream: true, temperature: Number($("temperature").value),
    max_tokens: Math.max(1, Number($("max-tokens").value) || 1),
  };
  if (textMode) {  // the text so far, the model's continuations included, continued once more
    return {...settings, prompt: history.map((message) => message.content).join("")};
  }
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...history);
  return {...settings, messages};
}

// Server-sent events arrive in arbitrary pieces: split on lines, keep the unfinished tail for the next piece.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function send(text) {
  history.push({role: "user", content: text});
  addMessage("user", text);  // as typed: plain text, never markup
  const bubble = addMessage("assistant", "");
  const content = bubble.appendChild(document.createElement("div"));
  // A continuation of the user's text is the middle of a document, not Markdown of its own: shown as text
  const view = typeof AnswerView === "function" ? new AnswerView(content, !textMode) : plainView(content);
  let answer = "";
  controller = new AbortController();
  setBusy(true);
  let finish = null;
  try {
    const response = await api(textMode ? "/v1/completions" : "/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
    }
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);
      for (const choice of event.choices || []) {
        const delta = choice.delta || {text: choice.text};  // chat's delta, or a completion's text
        answer += (delta.reasoning_content || "") + (delta.content || "") + (delta.text || "");
        view.update(answer);
        finish = choice.finish_reason || finish;
      }
    }
    view.finish(answer);
  } catch (error) {
    if (error.name === "AbortError") {
      finish = "stopped";
      view.finish(answer);
    } else {
      view.stop();
      bubble.className = "message error";
      bubble.textContent = `${answer}\n${error.message}`;
      finish = "error";
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  if (answer) history.push({role: "assistant", content: answer});
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = finish === "length" ? "(max tokens reached)" : finish === "stopped" ? "(stopped)" : "";
  if (note.textContent) bubble.appendChild(note);
  bubble.scrollIntoView({block: "end"});
}

// Prometheus text: "name value" lines; the unlabelled samples are all the panel needs.
function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (line.startsWith("#") || line.includes("{")) continue;
    const [name, value] = line.split(" ");
    if (name) values[name] = Number(value);
  }
  return values;
}

let lastTokens = null;
async function pollMetrics() {
  try {
    const values = parseMetrics(await (await api("/metrics")).text());
    const now = performance.now();
    $("running").textContent = values["pagellm:num_requests_running"] ?? "–";
    $("waiting").textContent = values["pagellm:num_requests_waiting"] ?? "–";
    const usage = values["pagellm:kv_cache_usage_ratio"];
    $("kv").textContent = usage === undefined ? "–" : `${(100 * usage).toFixed(1)} %`;
    const tokens = values["pagellm:generation_tokens_total"];
    if (tokens !== undefined && lastTokens) {
      const rate = (tokens - lastTokens.tokens) / ((now - lastTokens.time) / 1000);
      $("tps").textContent = rate.toFixed(1);
    }
    if (tokens !== undefined) lastTokens = {tokens, time: now};
    $("status").textContent = "";
  } catch (error) {
    $("status").textContent = "metrics unavailable";
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  history.length = 0;
  $("transcript").replaceChildren();
});
$("temperature").addEventListener("input", () => { $("temperature-value").textContent = $("temperature").value; });

loadModel();
pollMetrics();
setInterval(pollMetrics, 1000);
