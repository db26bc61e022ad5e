"use strict";
/* The chat page of `realizar serve`: one conversation with the served model, streamed from
   POST v1/chat/completions as Server-Sent Events (OpenAI's chunk format, ending with `data: [DONE]`).

   The server keeps nothing between requests, so every turn sends the whole conversation (its prefix cache
   makes the repeated part cheap). Stop aborts the fetch: the connection closes and the server cancels the
   generation at once. The paths are relative, so the page also works behind a proxy that serves it under a
   prefix. Model text reaches the page through renderMarkdown (markdown.js, which escapes it) or textContent,
   never as raw HTML. */

const $ = (id) => document.getElementById(id);
const el = {
  messages: $("messages"), composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  newChat: $("new-chat"), model: $("model"), system: $("system"), temperature: $("temperature"),
  topP: $("top-p"), maxTokens: $("max-tokens"), apiKey: $("api-key"), tps: $("tps"), error: $("error"),
};

let turns = [];        // the conversation: {role: "user" | "assistant", content}, the system prompt aside
let inFlight = null;   // the AbortController of the reply being streamed

// ---- settings, kept in localStorage from one visit to the next

for (const input of [el.system, el.temperature, el.topP, el.maxTokens, el.apiKey]) {
  const key = "realizar." + input.id;
  const saved = localStorage.getItem(key);
  if (saved !== null) input.value = saved;
  input.addEventListener("input", () => localStorage.setItem(key, input.value));
}

function headers() {
  const key = el.apiKey.value.trim();
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

/* A number field's value (undefined when empty: the server's default then), or an error naming it. */
function number(input, name, integer = false) {
  const raw = input.value.trim();
  if (raw === "") return undefined;
  const value = Number(raw);
  if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    throw new Error(`${name} must be ${integer ? "a whole number" : "a number"}, not "${raw}"`);
  }
  return value;
}

function samplingSettings() {
  const settings = {
    temperature: number(el.temperature, "temperature"),
    top_p: number(el.topP, "top_p"),
    max_tokens: number(el.maxTokens, "max tokens", true),
  };
  return Object.fromEntries(Object.entries(settings).filter(([, v]) => v !== undefined));
}

// ---- talking to the server

/* The message of a failed response: the server's error body (OpenAI's shape) when it sent one. */
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error?.message ?? message;
  } catch { /* not JSON: the status line it is */ }
  return response.status === 401 ? `${message} (set the API key in the settings)` : message;
}

async function loadModels() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await failure(response));
    const { data } = await response.json();
    el.model.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    showError("");
  } catch (e) {
    el.model.replaceChildren();
    showError(`cannot list the models: ${e.message}`);
  }
}

/* The events of a Server-Sent Events body, parsed as JSON, in batches: those that came in one read (the
   reply is drawn once per batch). Stops at `data: [DONE]`; a body that ends before it is an error. */
async function* eventBatches(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the stream ended before [DONE]");
    buffer += value.replace(/\r/g, "");
    const blocks = buffer.split("\n\n");
    buffer = blocks.pop();
    const batch = [];
    for (const line of blocks.join("\n").split("\n")) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") {
        yield batch;
        return;
      }
      batch.push(JSON.parse(data));
    }
    if (batch.length) yield batch;
  }
}

// ---- the conversation on the page

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  if (role === "user") div.textContent = text;
  else div.innerHTML = renderMarkdown(text);
  el.messages.append(div);
  el.messages.scrollTop = el.messages.scrollHeight;
  return div;
}

function showError(message) {
  el.error.textContent = message;
}

/* Draw the reply so far; the view follows it down unless the reader has scrolled up. */
function drawReply(div, text) {
  const m = el.messages;
  const following = m.scrollHeight - m.scrollTop - m.clientHeight < 40;
  div.innerHTML = renderMarkdown(text);
  if (following) m.scrollTop = m.scrollHeight;
}

/* The speed readout: tokens after the first over the time since the first (the decode rate, prefill aside),
   and the wait for the first. */
function showSpeed(tokens, startedAt, firstAt, now, note = "") {
  if (!firstAt) {
    el.tps.textContent = note;
    return;
  }
  const seconds = (now - firstAt) / 1000;
  const rate = tokens > 1 && seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) : "-";
  const wait = ((firstAt - startedAt) / 1000).toFixed(2);
  el.tps.textContent = `${tokens} tokens · ${rate} tok/s · first token after ${wait} s${note}`;
}

function setBusy(busy) {
  el.send.disabled = busy;
  el.stop.disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

async function send() {
  const text = el.prompt.value.trim();
  if (!text || inFlight) return;
  let settings;
  try {
    settings = samplingSettings();
    if (!el.model.value) throw new Error("no model to talk to (is the API key set?)");
  } catch (e) {
    showError(e.message);
    return;
  }
  showError("");
  el.prompt.value = "";
  const history = turns;  // (a new chat started meanwhile leaves this one's history behind)
  history.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const answer = addMessage("assistant", "");
  answer.classList.add("streaming");
  const system = el.system.value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history];

  const controller = (inFlight = new AbortController());
  setBusy(true);
  let reply = "", deltas = 0, usage = null, finish = null, firstAt = 0;
  const startedAt = performance.now();
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ model: el.model.value, messages, stream: true,
                             stream_options: { include_usage: true }, ...settings }),
    });
    if (!response.ok) throw new Error(await failure(response));
    for await (const batch of eventBatches(response.body)) {
      for (const event of batch) {
        if (event.error) throw new Error(event.error.message);
        const choice = event.choices?.[0];
        if (choice?.delta?.content) {
          firstAt ||= performance.now();
          reply += choice.delta.content;
          deltas += 1;
        }
        finish = choice?.finish_reason ?? finish;
        usage = event.usage ?? usage;
      }
      drawReply(answer, reply);
      showSpeed(deltas, startedAt, firstAt, performance.now());
    }
    const note = finish === "length" ? " · cut at max tokens" : "";
    showSpeed(usage?.completion_tokens ?? deltas, startedAt, firstAt, performance.now(), note);
  } catch (e) {
    const stopped = e.name === "AbortError";
    if (history !== turns) return;  // (a new chat stopped this one: nothing of it is shown any more)
    if (!stopped) showError(e.message);
    showSpeed(deltas, startedAt, firstAt, performance.now(), stopped ? " · stopped" : "");
  } finally {
    answer.classList.remove("streaming");
    if (reply) {
      history.push({ role: "assistant", content: reply });
    } else {  // nothing came: the exchange is taken back, and the prompt put back to send again
      history.pop();
      question.remove();
      answer.remove();
      if (history === turns && !el.prompt.value) el.prompt.value = text;
    }
    if (inFlight === controller) {
      inFlight = null;
      setBusy(false);
    }
  }
}

function stop() {
  inFlight?.abort();
}

function newChat() {
  stop();
  inFlight = null;
  setBusy(false);
  turns = [];
  el.messages.replaceChildren();
  el.tps.textContent = "";
  showError("");
  el.prompt.focus();
}

// ---- wiring

el.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
el.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    el.composer.requestSubmit();
  }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape") stop();
});
el.stop.addEventListener("click", stop);
el.newChat.addEventListener("click", newChat);
el.apiKey.addEventListener("change", loadModels);
el.messages.addEventListener("click", (e) => {  // a code block's copy button
  const button = e.target.closest("button.copy");
  if (!button) return;
  const code = button.closest(".code").querySelector("code").textContent;
  navigator.clipboard?.writeText(code).then(() => {
    button.textContent = "copied";
    setTimeout(() => (button.textContent = "copy"), 1200);
  }, () => (button.textContent = "cannot copy"));
});

loadModels();
el.prompt.focus();
