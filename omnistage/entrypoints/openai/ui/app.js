// omnistage demo page: chat over the server's own OpenAI API, with streamed text and speech.
// Plain browser JavaScript, no build step, nothing fetched from anywhere but this server.
"use strict";

const SAMPLE_RATE = 24000; // streamed speech: base64 PCM16 mono at 24 kHz
const $ = (id) => document.getElementById(id);
const state = { messages: [], attachments: [], models: [], busy: false, recorder: null, listing: 0 };

// ------------------------------------------------------------ HTTP

function headers() {
  const key = $("api-key").value.trim();
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The server's OpenAI error body says what went wrong: {"error": {"message": ...}}.
async function errorMessage(res) {
  const text = await res.text();
  try {
    const msg = JSON.parse(text).error.message;
    if (msg) return `${res.status}: ${msg}`;
  } catch (_) { /* not JSON */ }
  return `${res.status} ${res.statusText}${text ? `: ${text.slice(0, 300)}` : ""}`;
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

// Server-sent events from a fetch() body: yields each `data:` payload, parsed, until [DONE].
async function* sse(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// ------------------------------------------------------------ audio

function base64ToBytes(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return bytes;
}

function bytesToBase64(bytes) {
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(bin);
}

// A WAV file of PCM16 mono `pcm` (Uint8Array, little-endian samples) at `rate`.
function wavBlob(pcm, rate) {
  const head = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((c, i) => head.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF"); head.setUint32(4, 36 + pcm.length, true); text(8, "WAVE");
  text(12, "fmt "); head.setUint32(16, 16, true); head.setUint16(20, 1, true); head.setUint16(22, 1, true);
  head.setUint32(24, rate, true); head.setUint32(28, rate * 2, true); head.setUint16(32, 2, true);
  head.setUint16(34, 16, true); text(36, "data"); head.setUint32(40, pcm.length, true);
  return new Blob([head, pcm], { type: "audio/wav" });
}

// Float samples in [-1, 1] -> PCM16 bytes.
function floatToPcm16(samples) {
  const out = new DataView(new ArrayBuffer(samples.length * 2));
  samples.forEach((s, i) => out.setInt16(i * 2, Math.max(-1, Math.min(1, s)) * 0x7fff, true));
  return new Uint8Array(out.buffer);
}

let audioContext = null;
function getAudioContext() { // made (or resumed) in a click handler, where browsers allow sound
  audioContext = audioContext || new AudioContext({ sampleRate: SAMPLE_RATE });
  if (audioContext.state === "suspended") audioContext.resume();
  return audioContext;
}

// Plays PCM16 chunks as they arrive, each scheduled right after the previous one, and keeps them all
// so the whole reply becomes a WAV to replay.
class SpeechPlayer {
  constructor() { this.ctx = getAudioContext(); this.next = 0; this.parts = []; this.bytes = 0; }

  push(b64) {
    const bytes = base64ToBytes(b64);
    const n = bytes.length >> 1;
    if (!n) return;
    this.parts.push(bytes.subarray(0, n * 2));
    this.bytes += n * 2;
    const view = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
    const buffer = this.ctx.createBuffer(1, n, SAMPLE_RATE);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < n; i++) channel[i] = view.getInt16(i * 2, true) / 32768;
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    const at = Math.max(this.next, this.ctx.currentTime + 0.05);
    source.start(at);
    this.next = at + buffer.duration;
    document.body.dataset.audioChunks = Number(document.body.dataset.audioChunks) + 1;
  }

  wav() {
    const pcm = new Uint8Array(this.bytes);
    let at = 0;
    for (const p of this.parts) { pcm.set(p, at); at += p.length; }
    return wavBlob(pcm, SAMPLE_RATE);
  }
}

// ------------------------------------------------------------ models and tabs

async function loadModels() {
  const select = $("model");
  const listing = ++state.listing; // only the latest listing (the latest key) counts
  try {
    const res = await fetch("/v1/models", { headers: headers() });
    if (!res.ok) throw new Error(await errorMessage(res));
    const models = (await res.json()).data;
    if (listing !== state.listing) return;
    state.models = models;
    const previous = select.value;
    select.replaceChildren(...state.models.map((m) => new Option(m.id, m.id)));
    if (state.models.some((m) => m.id === previous)) select.value = previous;
    showError("");
  } catch (err) {
    if (listing !== state.listing) return;
    state.models = [];
    select.replaceChildren();
    showError(`Could not list the models: ${err.message}`);
  }
  modelChanged();
  probeTabs();
}

function modelChanged() {
  const card = state.models.find((m) => m.id === $("model").value);
  const speaks = Boolean(card && (card.output_modalities || []).includes("audio"));
  $("speak").disabled = !speaks;
  $("speak").checked = speaks;
  $("voice").disabled = !speaks;
  document.body.dataset.speaks = speaks;
}

// A tab's endpoint exists unless an (empty, so invalid) POST to it is a 404.
async function probeTabs() {
  for (const button of document.querySelectorAll("#tabs [data-probe]")) {
    const text = document.querySelector(`#tab-${button.dataset.tab} .probe`);
    const path = button.dataset.probe;
    let status = 0;
    try {
      status = (await fetch(path, { method: "POST", headers: headers(), body: "{}" })).status;
    } catch (_) { /* network error: status 0 */ }
    const missing = status === 404 || status === 405;
    button.classList.toggle("unavailable", missing);
    button.dataset.available = !missing && status !== 0 && status !== 401;
    text.textContent = missing ? `Not available: this server has no ${path} endpoint.`
      : status === 401 ? `Enter a valid API key to check whether ${path} is served.`
      : status === 0 ? `Could not reach the server to check ${path}.`
      : `This server serves ${path}; this page has no form for it yet: call it with any OpenAI client.`;
  }
}

function showTab(name) {
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".panel")) p.hidden = p.id !== `tab-${name}`;
}

// ------------------------------------------------------------ attachments and the microphone

function readAsDataURL(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

function audioFormat(file) {
  const ext = (file.name || "").split(".").pop().toLowerCase();
  const known = ["wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "aac"];
  return known.includes(ext) ? ext : (file.type.split("/")[1] || "wav").split(";")[0];
}

async function attach(file) {
  const url = await readAsDataURL(file);
  let part;
  if (file.type.startsWith("image/")) part = { type: "image_url", image_url: { url } };
  else if (file.type.startsWith("video/")) part = { type: "video_url", video_url: { url } };
  else part = { type: "input_audio", input_audio: { data: url.split(",")[1], format: audioFormat(file) } };
  state.attachments.push({ name: file.name, part, url });
  renderAttachments();
}

function renderAttachments() {
  $("attachments").replaceChildren(...state.attachments.map((a, i) => {
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.textContent = a.name;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = "remove";
    remove.onclick = () => { state.attachments.splice(i, 1); renderAttachments(); };
    chip.append(remove);
    return chip;
  }));
}

// Recording: MediaRecorder's webm/ogg, decoded by the browser and re-encoded as a mono WAV (which every
// server decodes); where decoding fails, the recording is sent as it is.
async function toggleRecording() {
  const button = $("record");
  if (state.recorder) { state.recorder.stop(); return; }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (err) {
    showError(`No microphone: ${err.message} (browsers allow one only on https:// or http://localhost)`);
    return;
  }
  const recorder = new MediaRecorder(stream);
  const chunks = [];
  recorder.ondataavailable = (e) => chunks.push(e.data);
  recorder.onstop = async () => {
    stream.getTracks().forEach((t) => t.stop());
    state.recorder = null;
    button.classList.remove("recording");
    button.textContent = "Record";
    const blob = new Blob(chunks, { type: recorder.mimeType });
    let file;
    try {
      const decoded = await getAudioContext().decodeAudioData(await blob.arrayBuffer());
      file = new File([wavBlob(floatToPcm16(decoded.getChannelData(0)), decoded.sampleRate)], "recording.wav",
        { type: "audio/wav" });
    } catch (_) {
      file = new File([blob], `recording.${audioFormat({ type: recorder.mimeType })}`, { type: recorder.mimeType });
    }
    await attach(file);
  };
  recorder.start();
  state.recorder = recorder;
  button.classList.add("recording");
  button.textContent = "Stop";
}

// ------------------------------------------------------------ chat

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  $("log").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function buildRequest(content) {
  const body = { messages: [...state.messages, { role: "user", content }], stream: true,
                 stream_options: { include_usage: true } };
  if ($("model").value) body.model = $("model").value;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  if ($("speak").checked) {
    body.modalities = ["text", "audio"];
    body.audio = { voice: $("voice").value.trim() || undefined, format: "pcm16" };
  }
  const extra = $("extra").value.trim();
  if (extra) {
    try { Object.assign(body, JSON.parse(extra)); } catch (err) { throw new Error(`Extra request fields: ${err.message}`); }
  }
  return body;
}

async function send(event) {
  event.preventDefault();
  if (state.busy) return;
  const text = $("prompt").value.trim();
  if (!text && !state.attachments.length) return;
  const content = state.attachments.length
    ? [...state.attachments.map((a) => a.part), ...(text ? [{ type: "text", text }] : [])] : text;
  let body;
  try { body = buildRequest(content); } catch (err) { showError(err.message); return; }
  showError("");
  const userDiv = addMessage("user", text);
  for (const a of state.attachments) {
    if (a.part.type === "image_url") { const img = new Image(); img.src = a.url; userDiv.append(img); }
    else { const meta = document.createElement("span"); meta.className = "meta"; meta.textContent = `attached: ${a.name}`; userDiv.append(meta); }
  }
  const answer = addMessage("assistant", "");
  const out = answer.querySelector(".text");
  const player = body.modalities ? new SpeechPlayer() : null;
  setBusy(true);
  const started = performance.now();
  let reply = "", firstToken = null, usage = null, failed = false;
  try {
    const res = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!res.ok) throw new Error(await errorMessage(res));
    for await (const chunk of sse(res)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!delta) continue;
      if (delta.content) {
        firstToken = firstToken ?? performance.now() - started;
        reply += delta.content;
        out.textContent = reply;
        answer.dataset.deltas = Number(answer.dataset.deltas || 0) + 1;
        answer.scrollIntoView({ block: "end" });
      }
      if (delta.audio && delta.audio.data && player) player.push(delta.audio.data);
    }
    state.messages.push({ role: "user", content }, { role: "assistant", content: reply });
    state.attachments = [];
    renderAttachments();
    $("prompt").value = "";
  } catch (err) {
    failed = true;
    answer.classList.add("failed");
    showError(err.message);
  } finally {
    setBusy(false);
    finish(answer, player, started, firstToken, usage, failed);
  }
}

function finish(answer, player, started, firstToken, usage, failed) {
  if (player && player.bytes) {
    const audio = document.createElement("audio");
    audio.controls = true;
    audio.src = URL.createObjectURL(player.wav());
    answer.append(audio);
  }
  const meta = document.createElement("span");
  meta.className = "meta";
  const parts = failed ? ["failed (see the error above)"] : [];
  if (firstToken !== null) parts.push(`first token ${Math.round(firstToken)} ms`);
  parts.push(`total ${Math.round(performance.now() - started)} ms`);
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  if (player && player.bytes) parts.push(`${(player.bytes / 2 / SAMPLE_RATE).toFixed(2)} s of speech`);
  meta.textContent = parts.join(" · ");
  answer.append(meta);
}

function setBusy(busy) {
  state.busy = busy;
  $("send").disabled = busy;
  document.body.dataset.state = busy ? "busy" : "idle";
}

// ------------------------------------------------------------ wiring

function init() {
  const key = $("api-key");
  key.value = localStorage.getItem("omnistage.apiKey") || "";
  key.addEventListener("change", () => { localStorage.setItem("omnistage.apiKey", key.value.trim()); loadModels(); });
  $("model").addEventListener("change", modelChanged);
  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e); });
  $("files").addEventListener("change", async (e) => {
    for (const file of e.target.files) await attach(file);
    e.target.value = "";
  });
  $("record").addEventListener("click", toggleRecording);
  $("record").disabled = !(navigator.mediaDevices && window.MediaRecorder);
  $("clear").addEventListener("click", () => { state.messages = []; $("log").replaceChildren(); showError(""); });
  for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  loadModels();
}

init();
