// The Empatheia page: one POST /api/turn per turn (docs/design.md "Serving"). No framework, nothing fetched
// from elsewhere: media are recorded in the browser and sent as base64 in the JSON body.
"use strict";
const $ = (id) => document.getElementById(id);
const state = { conversation: null, audio: null, video: null, busy: false };

function status(message, error = false) {
  $("status").textContent = message;
  $("status").className = error ? "error" : "";
}

function fill(select, values, pick) {
  select.innerHTML = "";
  for (const v of values) {
    const o = document.createElement("option");
    o.value = o.textContent = v;
    if (v === pick) o.selected = true;
    select.appendChild(o);
  }
}

async function init() {
  const r = await fetch("/api/health");
  const h = await r.json();
  const c = h.listener_choices;
  fill($("age"), c.age, "young");
  fill($("gender"), c.gender, "female");
  fill($("timbre"), c.timbre, "mid");
  $("model").textContent = h.ckpt ? `model: ${h.ckpt}` : "";
  status("ready");
}

function asBase64(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",")[1] || "");
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

// Microphone -> mono 16-bit PCM WAV (what the server accepts), through the browser's own decoder.
function wavOf(buffer) {
  const rate = buffer.sampleRate, data = buffer.getChannelData(0), n = data.length;
  const out = new DataView(new ArrayBuffer(44 + 2 * n));
  const str = (o, s) => { for (let i = 0; i < s.length; i++) out.setUint8(o + i, s.charCodeAt(i)); };
  str(0, "RIFF"); out.setUint32(4, 36 + 2 * n, true); str(8, "WAVE"); str(12, "fmt ");
  out.setUint32(16, 16, true); out.setUint16(20, 1, true); out.setUint16(22, 1, true);
  out.setUint32(24, rate, true); out.setUint32(28, 2 * rate, true); out.setUint16(32, 2, true);
  out.setUint16(34, 16, true); str(36, "data"); out.setUint32(40, 2 * n, true);
  for (let i = 0; i < n; i++) out.setInt16(44 + 2 * i, Math.max(-1, Math.min(1, data[i])) * 32767, true);
  return new Blob([out.buffer], { type: "audio/wav" });
}

function recorder(button, constraints, mime, done) {
  let rec = null;
  button.onclick = async () => {
    if (rec) { rec.stop(); return; }
    try {
      const stream = await navigator.mediaDevices.getUserMedia(constraints);
      const type = mime.find((m) => MediaRecorder.isTypeSupported(m)) || "";
      rec = new MediaRecorder(stream, type ? { mimeType: type } : {});
      const chunks = [];
      rec.ondataavailable = (e) => chunks.push(e.data);
      rec.onstop = async () => {
        stream.getTracks().forEach((t) => t.stop());
        button.textContent = "record";
        const blob = new Blob(chunks, { type: rec.mimeType });
        rec = null;
        await done(blob);
      };
      rec.start();
      button.textContent = "stop";
    } catch (e) {
      status(`cannot record: ${e.message}`, true);
    }
  };
}

recorder($("mic"), { audio: true }, ["audio/webm", "audio/ogg"], async (blob) => {
  const ctx = new AudioContext();
  const buffer = await ctx.decodeAudioData(await blob.arrayBuffer());
  state.audio = await asBase64(wavOf(buffer));
  $("audio-in").textContent = `recorded ${buffer.duration.toFixed(1)} s`;
});
recorder($("cam"), { video: true, audio: false }, ["video/mp4;codecs=avc1", "video/mp4", "video/webm"],
  async (blob) => {
    state.video = await asBase64(blob);
    $("video-in").textContent = `recorded ${(blob.size / 1024).toFixed(0)} kB`;
  });
$("audio-file").onchange = async (e) => {
  const f = e.target.files[0];
  state.audio = f ? await asBase64(f) : null;
  $("audio-in").textContent = f ? f.name : "";
};
$("video-file").onchange = async (e) => {
  const f = e.target.files[0];
  state.video = f ? await asBase64(f) : null;
  $("video-in").textContent = f ? f.name : "";
};

function addHistory(who, text) {
  const li = document.createElement("li");
  const b = document.createElement("span");
  b.className = "who";
  b.textContent = who + ":";
  li.appendChild(b);
  li.appendChild(document.createTextNode(text));
  $("history").appendChild(li);
}

function show(r) {
  $("reply").textContent = r.reply;
  $("emotion").textContent = `emotion: ${r.emotion || "-"}` +
    (r.emotion_text ? ` (chain of empathy: ${r.emotion_text})` : "");
  const coe = $("coe");
  coe.innerHTML = "";
  for (const [k, v] of Object.entries(r.coe || {})) {
    if (!v) continue;
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k;
    dd.textContent = v;
    coe.append(dt, dd);
  }
  const who = r.listener;  // the avatar the server spoke and drew the reply as
  $("avatar").textContent = who ? `listener avatar: ${who.age}/${who.gender}/${who.timbre} (pinned)`
    : "listener avatar: predicted";
  $("prompt").textContent = r.prompt_length ? `prompt: ${r.prompt_length} tokens` : "";
  const t = r.timings || {};
  $("timings").textContent = ["decode", "speech", "video", "queue", "total"]
    .filter((k) => k in t).map((k) => `${k} ${t[k].toFixed(2)} s`).join(" · ");
  for (const [id, url] of [["audio", r.audio_url], ["video", r.video_url]]) {
    const el = $(id);
    if (url) { el.src = url; el.load(); } else { el.removeAttribute("src"); el.load(); }
  }
  addHistory("you", r.speaker_text);
  addHistory("Empatheia", r.reply);
}

async function send() {
  if (state.busy) return;
  const body = {
    conversation: state.conversation, text: $("text").value, audio: state.audio, video: state.video,
    render: $("render").value,
    listener: $("pin").checked ? { age: $("age").value, gender: $("gender").value, timbre: $("timbre").value }
      : null,
  };
  state.busy = true;
  $("send").disabled = true;
  const t0 = performance.now();
  const tick = setInterval(() => status(`thinking… ${((performance.now() - t0) / 1000).toFixed(0)} s`), 250);
  try {
    const res = await fetch("/api/turn", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    const r = await res.json().catch(() => ({ error: `HTTP ${res.status}` }));
    clearInterval(tick);
    if (!res.ok) {
      const retry = res.headers.get("Retry-After");
      status(`${r.error || "HTTP " + res.status}` + (retry ? ` (retry in ${retry} s)` : ""), true);
      return;
    }
    state.conversation = r.conversation;
    show(r);
    $("text").value = "";
    state.audio = state.video = null;
    $("audio-in").textContent = $("video-in").textContent = "";
    $("audio-file").value = $("video-file").value = "";
    status(`turn ${r.turn} answered in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
  } catch (e) {
    clearInterval(tick);
    status(`the server did not answer: ${e.message}`, true);
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

$("send").onclick = send;
$("text").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
$("reset").onclick = async () => {
  if (state.conversation) {
    await fetch("/api/reset", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ conversation: state.conversation }) });
  }
  state.conversation = null;
  $("history").innerHTML = "";
  for (const id of ["reply", "emotion", "avatar", "prompt", "timings"]) $(id).textContent = "";
  $("coe").innerHTML = "";
  status("new conversation");
};
init().catch((e) => status(`cannot reach the server: ${e.message}`, true));
