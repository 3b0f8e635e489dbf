// corral's chat page: talks to the same server's Ollama API (/api/tags, /api/show, /api/chat).
//
// Requests use relative URLs, so they are same-origin and pass the server's Origin and Host checks.
// The conversation and settings live in localStorage; answers render through renderMarkdown (markdown.js),
// which never parses HTML.
"use strict";

const STORAGE_KEY = "corral.chat";
const $ = (id) => document.getElementById(id);

const state = loadState();
let capabilities = [];
let running = null; // {controller, answer} while an answer streams

function loadState() {
  const fresh = { messages: [], settings: { model: "", system: "", temperature: 0.8, num_ctx: "", num_predict: "", json: false, think: false } };
  try {
    const saved = JSON.parse(localStorage.getItem(STORAGE_KEY) || "null");
    if (saved && Array.isArray(saved.messages) && saved.settings) return { messages: saved.messages, settings: { ...fresh.settings, ...saved.settings } };
  } catch {
    // A corrupt entry starts a fresh conversation rather than breaking the page.
  }
  return fresh;
}

function saveState() {
  localStorage.setItem(STORAGE_KEY, JSON.stringify(state));
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

async function apiError(response) {
  try {
    const body = await response.json();
    return typeof body.error === "string" ? body.error : JSON.stringify(body.error);
  } catch {
    return `HTTP ${response.status}`;
  }
}

// --- models ---------------------------------------------------------------------------------------

async function loadModels() {
  const response = await fetch("api/tags");
  if (!response.ok) throw new Error(await apiError(response));
  const { models } = await response.json();
  const picker = $("model");
  picker.replaceChildren(...models.map((m) => new Option(m.name, m.name)));
  if (!models.length) {
    setStatus("No models in the store: pull one with `corral pull smollm2`.", true);
    return;
  }
  const names = models.map((m) => m.name);
  picker.value = names.includes(state.settings.model) ? state.settings.model : names[0];
  await selectModel(picker.value);
}

let selecting = 0; // the latest selectModel call: an earlier one's answer arriving after it is dropped

async function selectModel(name) {
  const mine = ++selecting;
  state.settings.model = name;
  saveState();
  capabilities = [];
  delete $("model").dataset.shown;
  const response = await fetch("api/show", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model: name }) });
  const shown = response.ok ? (await response.json()).capabilities || [] : [];
  if (mine !== selecting) return; // the user (or the first listing) picked another model meanwhile
  capabilities = shown;
  const chats = capabilities.includes("completion");
  $("json-toggle").hidden = !chats;
  $("think-toggle").hidden = !capabilities.includes("thinking");
  $("send").disabled = !chats || running !== null;
  setStatus(chats ? "" : `${name} cannot chat (${capabilities.join(", ") || "unknown capabilities"})`, !chats);
  $("model").dataset.shown = name; // the controls now follow this model's capabilities
}

// --- settings -------------------------------------------------------------------------------------

function bindSettings() {
  const s = state.settings;
  $("system").value = s.system;
  $("temperature").value = s.temperature;
  $("num_ctx").value = s.num_ctx;
  $("num_predict").value = s.num_predict;
  $("json").checked = s.json;
  $("think").checked = s.think;
  for (const id of ["system", "temperature", "num_ctx", "num_predict"]) {
    $(id).addEventListener("input", () => { s[id] = $(id).value; saveState(); });
  }
  for (const id of ["json", "think"]) {
    $(id).addEventListener("change", () => { s[id] = $(id).checked; saveState(); });
  }
  $("model").addEventListener("change", () => selectModel($("model").value));
}

function requestOptions() {
  const s = state.settings;
  const options = {};
  const temperature = parseFloat(s.temperature);
  if (Number.isFinite(temperature)) options.temperature = temperature;
  const numCtx = parseInt(s.num_ctx, 10);
  if (numCtx > 0) options.num_ctx = numCtx;
  const numPredict = parseInt(s.num_predict, 10);
  if (Number.isInteger(numPredict) && numPredict !== 0) options.num_predict = numPredict;
  return options;
}

// --- the conversation -----------------------------------------------------------------------------

function renderMessage(message) {
  const article = document.createElement("article");
  article.className = `message ${message.role}`;
  const header = document.createElement("header");
  header.className = "who";
  header.textContent = message.role === "user" ? "You" : message.model || "assistant";
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thought = document.createElement("div");
  thinking.append(summary, thought);
  const body = document.createElement("div");
  body.className = "content";
  const stats = document.createElement("footer");
  stats.className = "stats";
  article.append(header, thinking, body, stats);
  $("conversation").append(article);
  const view = { article, body, thought, thinking, stats, message };
  updateMessage(view);
  return view;
}

function updateMessage(view) {
  const { message } = view;
  view.body.replaceChildren(message.role === "user" ? document.createTextNode(message.content) : renderMarkdown(message.content));
  view.thinking.hidden = !message.thinking;
  view.thought.replaceChildren(renderMarkdown(message.thinking || ""));
  view.stats.textContent = describeStats(message);
  view.article.classList.toggle("error", Boolean(message.error));
}

function describeStats(message) {
  const parts = [];
  if (message.error) parts.push(`error: ${message.error}`);
  if (message.stopped) parts.push("stopped");
  const st = message.stats;
  if (st) {
    if (st.tokens_per_second !== undefined) parts.push(`${st.tokens_per_second.toFixed(1)} tokens/s`);
    if (st.ttft_ms !== undefined) parts.push(`first token ${(st.ttft_ms / 1000).toFixed(2)} s`);
    if (st.eval_count !== undefined) parts.push(`${st.eval_count} tokens`);
  }
  return parts.join(" · ");
}

function renderConversation() {
  $("conversation").replaceChildren();
  for (const message of state.messages) renderMessage(message);
}

function historyForRequest() {
  const messages = [];
  if (state.settings.system.trim()) messages.push({ role: "system", content: state.settings.system });
  for (const m of state.messages) {
    if (m.error && !m.content) continue;
    messages.push({ role: m.role, content: m.content });
  }
  return messages;
}

// --- streaming an answer --------------------------------------------------------------------------

async function send(text) {
  const model = state.settings.model;
  state.messages.push({ role: "user", content: text });
  renderMessage(state.messages[state.messages.length - 1]);
  const body = { model, messages: historyForRequest(), stream: true, options: requestOptions() };
  if (state.settings.json && capabilities.includes("completion")) body.format = "json";
  if (capabilities.includes("thinking")) body.think = state.settings.think;
  const answer = { role: "assistant", content: "", thinking: "", model };
  state.messages.push(answer);
  saveState();
  const view = renderMessage(answer);
  const controller = new AbortController();
  running = { controller, view };
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let chunks = 0;
  try {
    const response = await fetch("api/chat", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await apiError(response));
    for await (const chunk of ndjson(response.body)) {
      if (chunk.error) throw new Error(chunk.error);
      const piece = chunk.message || {};
      if ((piece.content || piece.thinking) && answer.stats === undefined) answer.stats = { ttft_ms: performance.now() - started };
      answer.content += piece.content || "";
      answer.thinking += piece.thinking || "";
      chunks += 1;
      view.article.dataset.chunks = String(chunks);
      if (chunk.done) {
        answer.stats = { ...(answer.stats || {}), eval_count: chunk.eval_count, done_reason: chunk.done_reason };
        if (chunk.eval_duration > 0) answer.stats.tokens_per_second = chunk.eval_count / (chunk.eval_duration / 1e9);
      }
      scheduleUpdate(view);
    }
  } catch (error) {
    if (error.name === "AbortError") answer.stopped = true;
    else answer.error = error.message;
  } finally {
    running = null;
    view.article.dataset.done = "true";
    updateMessage(view);
    saveState();
    $("stop").disabled = true;
    $("send").disabled = !capabilities.includes("completion");
  }
}

let pending = null;
function scheduleUpdate(view) {
  // Re-render at most once a frame: a fast model sends far more chunks than the screen shows.
  if (pending) return;
  pending = requestAnimationFrame(() => { pending = null; updateMessage(view); });
}

async function* ndjson(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let newline;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, newline).trim();
      buffer = buffer.slice(newline + 1);
      if (line) yield JSON.parse(line);
    }
  }
  if (buffer.trim()) yield JSON.parse(buffer);
}

// --- wiring ---------------------------------------------------------------------------------------

function bindComposer() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || running || $("send").disabled) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (running) running.controller.abort();
    state.messages = [];
    saveState();
    renderConversation();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  bindSettings();
  bindComposer();
  renderConversation();
  loadModels().catch((error) => setStatus(`Could not list models: ${error.message}`, true));
});
