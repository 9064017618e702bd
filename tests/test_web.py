"""`empatheia serve`: the HTTP API and the page, on a real server process and in a real browser.

- The input checks, the bounded queue, eviction and history trimming run in-process on a `web.Server` whose
  turn function is a stub (no model): every bad input is a 4xx naming the problem, a full queue a 503 with
  Retry-After, and the server keeps answering after each; a conversation over `max_conversations` evicts
  the least recently used one (its folder deleted); a history keeps its last `max_history` utterances.
- One `empatheia serve --queue 3` subprocess on the tiny trained run (stage coe, 1 step, real Kokoro/face
  targets) is shared by the module: a turn with speech, video and a pinned avatar, whose uploads lengthen
  the prompt; the second turn's prompt holds the first (and a reset forgets it); the turn latency excludes
  loading; the README's curl request; a prompt over the context limit; a full queue (a turn held on a named
  pipe) answered 503; a load test (two rounds of 24 turns from 4 concurrent clients, every answer's turn
  and history checked, RSS steady over the second); and Debian's chromium driven by Selenium through the
  page (CI=true fails without the browser).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import make_tiny_shards, require, saved_smollm2_tokenizer
from test_cli import REPO, cli, ok

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: object | None = None, *, raw: bytes | None = None, timeout: float = 300
            ) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a GET (no body) or a JSON POST."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def turn_ok(url: str, body: dict) -> dict:
    """The answer of a turn that must be served (200)."""
    code, r, _ = request(url + "/api/turn", body)
    assert code == 200, (code, r)
    return r


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def fetch_bytes(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        return e.code, b"", ""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def wav_bytes(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        t = np.arange(int(seconds * rate)) / rate
        w.writeframes((3000 * np.sin(2 * np.pi * 220 * t)).astype("<i2").tobytes())
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------------------
# In-process: input checks and the queue (a stub turn, no model)
# ----------------------------------------------------------------------------------------------------------


class Stub:
    """A turn function that waits for `gate` and echoes; records what it was given."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[dict] = []

    def __call__(self, **kw):
        self.calls.append(kw)
        self.gate.wait(60)
        return {"reply": f"echo {kw['text']}", "coe": {}, "emotion": "", "timings": {"decode": 0.0},
                "files": {}}


@contextlib.contextmanager
def in_thread(server) -> Iterator[str]:
    """`server`'s application on uvicorn in a thread of this process; yields its base URL, then stops it
    (its shutdown deletes every session folder)."""
    uvicorn = require("uvicorn", "empatheia serve runs on uvicorn (setup.py SERVE)")
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            request(url + "/api/health", timeout=2)
            break
        except OSError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        uv.should_exit = True
        thread.join(10)
    assert not server.root.exists()  # shutdown deleted every session folder


@pytest.fixture(scope="module")
def stub_server(tmp_path_factory):
    from empatheia_jax.serve import web

    stub = Stub()
    server = web.Server(stub, web.Limits(max_upload_bytes=200_000, max_media_seconds=2.0, queue=1,
                                         max_text_chars=500),
                        root=tmp_path_factory.mktemp("stub_serve"))
    with in_thread(server) as url:
        yield url, server, stub


@pytest.fixture
def small_server(tmp_path):
    """A stub server that holds 2 conversations of 4 utterances each."""
    from empatheia_jax.serve import web

    stub = Stub()
    server = web.Server(stub, web.Limits(max_conversations=2, max_history=4), root=tmp_path)
    with in_thread(server) as url:
        yield url, server, stub


@pytest.mark.parametrize("body,status,names", [
    ({"text": "  "}, 400, ["empty turn"]),
    ({"text": 3}, 400, ["text must be a string"]),
    ({"text": "x" * 501}, 413, ["text", "500-character limit"]),
    ({"text": "hi", "render": "hologram"}, 400, ["render", "hologram"]),
    ({"text": "hi", "mood": 1}, 400, ["unknown field", "mood"]),
    ({"text": "hi", "listener": {"age": "ancient", "gender": "female", "timbre": "mid"}}, 400,
     ["listener", "ancient"]),
    ({"text": "hi", "listener": "young"}, 400, ["listener must be an object"]),
    ({"text": "hi", "audio": "%%%"}, 400, ["audio", "base64"]),
    ({"text": "hi", "audio": b64(b"ID3\x03 an mp3 pretending")}, 415, ["audio", "not a WAV"]),
    ({"text": "hi", "audio": b64(b"RIFF\x10\x00\x00\x00WAVEjunkjunk")}, 422, ["audio", "corrupt"]),
    ({"text": "hi", "audio": b64(wav_bytes(2.5))}, 413, ["audio", "2.5 s", "2 s limit"]),
    ({"text": "hi", "audio": b64(b"RIFF" + bytes(300_000))}, 413, ["audio", "upload limit"]),
    ({"text": "hi", "video": b64(b"\x89PNG\r\n\x1a\n" + bytes(64))}, 415, ["video", "not an mp4"]),
    ({"text": "hi", "video": b64(b"\x00\x00\x00\x18ftypmp42" + os.urandom(4000))}, 422,
     ["video", "corrupt or unreadable mp4"]),
    ({"conversation": "nope", "text": "hi"}, 404, ["conversation", "unknown"]),
])
def test_bad_inputs_are_4xx_naming_the_problem(stub_server, body, status, names):
    url, server, stub = stub_server
    before = len(stub.calls)
    code, out, _ = request(url + "/api/turn", body)
    assert code == status, (code, out)
    for name in names:
        assert name in out["error"], (name, out)
    assert len(stub.calls) == before  # refused before the model
    assert request(url + "/api/turn", {"text": "still here"})[0] == 200  # and the server keeps serving
    assert not list(server.root.glob("*/turn*_in_*")), "a refused upload was left on disk"


def test_malformed_bodies_and_paths(stub_server):
    url, _, _ = stub_server
    code, out, _ = request(url + "/api/turn", raw=b"{not json")
    assert code == 400 and "not JSON" in out["error"]
    code, out, _ = request(url + "/api/turn", raw=b'["a list"]')
    assert code == 400 and "JSON object" in out["error"]
    # a declared body over the cap is refused from its headers, before any of it is read
    import http.client

    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    conn.putrequest("POST", "/api/turn")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", "700000")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and "limit" in json.loads(resp.read())["error"]
    conn.close()
    for path in ("/api/files/../../etc/passwd", "/api/files/abc/..%2F..%2Fetc%2Fpasswd",
                 "/static/..%2F..%2Fweb.py", "/api/files/abc/turn1_reply.wav"):
        code, _, _ = fetch_bytes(url + path)
        assert code == 404, path


def test_full_queue_answers_503_with_retry_after(stub_server):
    """Queue 1: one running turn plus one waiting fill it; the next is refused at once, then served."""
    url, server, stub = stub_server
    stub.gate.clear()
    with cf.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(request, url + "/api/turn", {"text": f"held {i}"}) for i in range(2)]
        deadline = time.monotonic() + 30
        while server.queue_state()["in_flight"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        code, out, headers = request(url + "/api/turn", {"text": "one too many"})
        assert code == 503 and "busy" in out["error"], (code, out)
        assert int(headers["retry-after"]) >= 1 and time.monotonic() - t0 < 5
        stub.gate.set()
        assert [f.result()[0] for f in held] == [200, 200]
    assert request(url + "/api/turn", {"text": "after"})[0] == 200


def test_stub_history_and_reset(stub_server):
    url, _, stub = stub_server
    code, first, _ = request(url + "/api/turn", {"text": "first"})
    assert code == 200 and first["history_length"] == 2
    code, second, _ = request(url + "/api/turn", {"conversation": first["conversation"], "text": "second"})
    assert code == 200 and second["turn"] == 2
    assert [h["utterance"] for h in stub.calls[-1]["history"]] == ["first", "echo first"]
    assert request(url + "/api/reset", {"conversation": first["conversation"]})[1] == {"reset": True}
    code, out, _ = request(url + "/api/turn", {"conversation": first["conversation"], "text": "third"})
    assert code == 404 and "new conversation" in out["error"]


def test_a_new_conversation_evicts_the_least_recently_used(small_server):
    """max_conversations 2: a third conversation is served, and the one used longest ago goes (its folder
    and upload deleted, its id then unknown); the other keeps its history."""
    url, server, _ = small_server
    a = turn_ok(url, {"text": "a1"})["conversation"]
    b = turn_ok(url, {"text": "b1", "audio": b64(wav_bytes(0.5))})["conversation"]
    assert list((server.root / b).glob("turn1_in_audio.wav"))
    assert turn_ok(url, {"conversation": a, "text": "a2"})["turn"] == 2  # a is now the more recent
    c = turn_ok(url, {"text": "c1"})
    assert c["turn"] == 1 and c["history_length"] == 2
    assert set(server.sessions) == {a, c["conversation"]}
    assert not (server.root / b).exists()
    code, out, _ = request(url + "/api/turn", {"conversation": b, "text": "b2"})
    assert code == 404 and "unknown" in out["error"], out
    r = turn_ok(url, {"conversation": a, "text": "a3"})
    assert (r["turn"], r["history_length"]) == (3, 4)


def test_history_keeps_the_last_max_history_utterances(small_server):
    """max_history 4: from turn 3 on, the oldest turn's two utterances leave the history (and its upload
    the disk), and the model reads the last four."""
    url, server, stub = small_server
    first = turn_ok(url, {"text": "turn 1", "audio": b64(wav_bytes(0.5))})
    sid = first["conversation"]
    [upload] = (server.root / sid).glob("turn1_in_audio.wav")
    answers = [first]
    for j in (2, 3, 4):
        answers.append(turn_ok(url, {"conversation": sid, "text": f"turn {j}"}))
        assert upload.exists() == (j < 3), j
    assert [(r["turn"], r["history_length"]) for r in answers] == [(1, 2), (2, 4), (3, 4), (4, 4)]
    assert [h["utterance"] for h in stub.calls[-1]["history"]] == ["turn 2", "echo turn 2", "turn 3",
                                                                   "echo turn 3"]


# ----------------------------------------------------------------------------------------------------------
# `empatheia serve` on the tiny trained run
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cli_env):
    tok = saved_smollm2_tokenizer(tmp_path_factory)
    shards = make_tiny_shards(tmp_path_factory.mktemp("web_data"), real_targets=True)
    workdir = tmp_path_factory.mktemp("web_run") / "coe"
    ok(cli(cli_env, "train", "--config", REPO / "configs" / "tiny.py", f"--config.model.tokenizer={tok}",
           f"--config.data.shards={shards}", f"--workdir={workdir}", "--config.stage=coe",
           "--config.schedule.coe.steps=1", "--config.optim.warmup_steps=0"))
    return workdir, shards.parent / "raw" / "media"


@pytest.fixture(scope="module")
def served(trained, cli_env, tmp_path_factory):
    """(base URL, process, seconds from launch to the first answer of /api/health)."""
    tmp = tmp_path_factory.mktemp("serve_tmp")
    env = {**cli_env, "TMPDIR": str(tmp)}
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "empatheia_jax.cli", "serve", "--ckpt", str(trained[0]),
                             "--port", str(port), "--max_new_tokens", "6", "--queue", "3"], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if request(url + "/api/health", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            proc.kill()
            pytest.fail(f"serve did not start: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    startup = time.monotonic() - t0
    yield url, proc, startup
    proc.terminate()
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"serve did not stop on SIGTERM: {proc.communicate()[1][-3000:]}")
    assert "Traceback" not in err, err[-3000:]
    assert "warm-up:" in out, out[-3000:]  # every prompt length compiled before the first turn
    assert not list(tmp.glob("empatheia-serve-*")), "serve left its session folders behind"


def test_turn_with_speech_video_and_pinned_avatar(served, trained):
    url, _, _ = served
    media = trained[1]
    body = {"text": "I feel so alone today.", "audio": b64((media / "diatest1utt2_7.wav").read_bytes()),
            "video": b64((media / "diatest1utt2_7.mp4").read_bytes()),
            "listener": {"age": "young", "gender": "female", "timbre": "mid"}, "render": "avatar"}
    code, r, _ = request(url + "/api/turn", body)
    assert code == 200, r
    assert isinstance(r["reply"], str) and set(r["coe"]) and r["emotion"]
    assert set(r["timings"]) >= {"decode", "speech", "video", "queue", "total"}
    assert any("listener avatar young/female/mid pinned" in n for n in r["notes"]), r["notes"]
    assert r["listener"] == body["listener"]
    # the same words without the uploads: the prompt loses the <Aud>/<Vid> placeholders of their features
    code, plain, _ = request(url + "/api/turn", {"text": body["text"], "render": "text"})
    assert code == 200 and plain["listener"] is None
    assert r["prompt_length"] > plain["prompt_length"], (r["prompt_length"], plain["prompt_length"])
    code, wav, ctype = fetch_bytes(url + r["audio_url"])
    assert code == 200 and ctype == "audio/wav"
    with wave.open(io.BytesIO(wav)) as w:
        seconds = w.getnframes() / w.getframerate()
    assert seconds == pytest.approx(r["speech_seconds"], abs=1e-3) and seconds > 0
    code, mp4, ctype = fetch_bytes(url + r["video_url"])
    assert code == 200 and ctype == "video/mp4"
    import av

    with av.open(io.BytesIO(mp4)) as c:
        assert c.streams.video[0].average_rate == 25 and c.streams.audio
        assert sum(1 for _ in c.decode(video=0)) == r["frames"] > 0


def test_second_turn_sees_the_first_and_excludes_loading(served):
    url, _, startup = served
    say = {"text": "My dog died last week.", "render": "text"}
    code, first, _ = request(url + "/api/turn", say)
    assert code == 200, first
    t0 = time.monotonic()
    code, second, _ = request(url + "/api/turn", {**say, "conversation": first["conversation"]})
    wall = time.monotonic() - t0
    assert code == 200 and second["history_length"] == 4
    # the same words after a history: the prompt holds the first turn (both utterances) before them
    assert second["prompt_length"] > first["prompt_length"]
    assert wall < startup, (wall, startup)  # the model was loaded once, before the server answered
    assert request(url + "/api/reset", {"conversation": first["conversation"]})[1] == {"reset": True}
    code, fresh, _ = request(url + "/api/turn", say)
    assert code == 200 and fresh["prompt_length"] == first["prompt_length"]


def test_audio_only_turn_is_transcribed_into_the_history(served, tmp_path):
    """A turn with speech and no text: Whisper tiny.en's transcript is the utterance the model read, and
    the one the next turn's history holds (the page lists it as what "you" said)."""
    import soundfile as sf

    from empatheia_jax.data.encoders import asr
    from empatheia_jax.generators.kokoro import SAMPLE_RATE
    from empatheia_jax.generators.kokoro_voices import gold_speech

    url, _, _ = served
    said = "My sister is moving to another country next week."
    wav = tmp_path / "said.wav"
    sf.write(wav, gold_speech(said, {"age": "middle-aged", "gender": "male", "timbre": "low"}, "sad")[0],
             SAMPLE_RATE, subtype="PCM_16")
    code, r, _ = request(url + "/api/turn", {"audio": b64(wav.read_bytes()), "render": "text"})
    assert code == 200, r
    [heard] = r["input_transcripts"]
    assert r["speaker_text"] == heard["transcript"]
    assert asr.word_error_rate([said], [r["speaker_text"]]) < 0.15, r["speaker_text"]
    code, again, _ = request(url + "/api/turn", {"conversation": r["conversation"], "text": "Yes.",
                                                 "render": "text"})
    assert code == 200 and again["history_length"] == 4 and not again["input_transcripts"]


def test_prompt_over_the_context_limit_is_413(served):
    url, _, _ = served
    code, out, _ = request(url + "/api/turn", {"text": "sad " * 900, "render": "text"})
    assert code == 413 and "text" in out["error"] and "256 tokens" in out["error"], out
    assert request(url + "/api/turn", {"text": "hello", "render": "text"})[0] == 200


def readme_curl() -> str:
    """The README's curl example of the API (the fenced block after `empatheia serve`)."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"```(?:sh|bash)?\n(curl [^`]*?/api/turn[^`]*?)```", text)
    assert m, "README.md has no curl example of /api/turn"
    return m.group(1).strip()


def test_readme_curl_request(served):
    url, _, _ = served
    command = readme_curl().replace("http://127.0.0.1:7860", url)
    p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["reply"] is not None and r["conversation"] and "decode" in r["timings"], r


def converse(url: str, client: int, turns: int = 6) -> None:
    """One client's conversation, each answer checked as it comes: 200, the same conversation, turn j with a
    history of 2j utterances (the speaker's and the reply of each turn so far)."""
    sid = None
    for j in range(1, turns + 1):
        said = f"client {client} turn {j}: I am worried about my exam."
        r = turn_ok(url, {"conversation": sid, "text": said, "render": "text"})
        assert (r["turn"], r["history_length"]) == (j, 2 * j), (client, j, r)
        assert sid in (None, r["conversation"]), (client, j, r)
        sid = r["conversation"]


def test_load_two_rounds_of_24_turns_from_4_clients(served):
    """4 clients x 6 turns, twice, under `--queue 3` (4 places: every turn fits, none may be refused):
    every answer is 200 with its conversation's turn and history length; the second round grows the
    server's RSS by under 32 MiB (the first is the warm-up: allocator pools, the threads' stacks)."""
    psutil = require("psutil", "RSS of the server process")
    url, proc, _ = served
    process = psutil.Process(proc.pid)

    def one_round() -> float:
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(converse, url, i) for i in range(4)]:
                f.result()
        return time.monotonic() - t0

    one_round()
    rss1 = process.memory_info().rss
    elapsed = one_round()
    grown = process.memory_info().rss - rss1
    assert grown < 32 * 2**20, f"the second round of 24 turns grew the RSS by {grown / 2**20:.1f} MiB"
    assert elapsed < 120, elapsed


def read_pipe(pipe: Path, timeout: float = 60) -> str:
    """What a writer writes into the named pipe `pipe` (opening it for reading releases a blocked writer)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(pipe.read_text()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert box, f"nothing wrote {pipe.name} within {timeout} s"
    return box[0]


def test_a_full_queue_is_503_on_the_real_server(served, tmp_path_factory):
    """`--queue 3`: a running turn and three waiting take the 4 places; the next turn is refused at once
    with 503 and Retry-After, then the four are answered. The running turn is held, not raced: its OUT.json
    (which `turn.run_turn` writes after generating) is a named pipe, and the worker blocks opening it until
    this test reads it."""
    url, _, _ = served
    sid = turn_ok(url, {"text": "Please hold on.", "render": "text"})["conversation"]
    found = tmp_path_factory.getbasetemp().glob(f"serve_tmp*/empatheia-serve-*/{sid}")
    [folder] = {p.resolve() for p in found}  # serve_tmp0 and its `serve_tmpcurrent` link
    pipe = folder / "turn2_reply.json"
    os.mkfifo(pipe)

    def in_flight() -> int:
        return request(url + "/api/health")[1]["queue"]["in_flight"]

    with cf.ThreadPoolExecutor(4) as pool:
        try:
            held = [pool.submit(request, url + "/api/turn", {"conversation": sid, "text": "Are you there?",
                                                             "render": "text"})]
            wait_until(lambda: in_flight() == 1, "the held turn to start")
            held += [pool.submit(request, url + "/api/turn", {"text": f"waiting {i}", "render": "text"})
                     for i in range(3)]
            wait_until(lambda: in_flight() == 4, "three turns waiting behind the held one")
            t0 = time.monotonic()
            # a server that queued it would answer only after the held turn: a short timeout
            code, out, headers = request(url + "/api/turn", {"text": "one too many", "render": "text"},
                                         timeout=10)
            refused_in = time.monotonic() - t0
            done_early = [f.done() for f in held]
        finally:
            written = json.loads(read_pipe(pipe))  # releases the held turn, whatever happened
        answers = [f.result() for f in held]
    assert code == 503 and "busy" in out["error"], (code, out)
    assert int(headers["retry-after"]) >= 1 and refused_in < 5, (headers, refused_in)
    assert not any(done_early), done_early
    assert [a[0] for a in answers] == [200] * 4, answers
    assert (answers[0][1]["turn"], answers[0][1]["history_length"]) == (2, 4)
    assert written["reply"] == answers[0][1]["reply"]  # the pipe was the held turn's OUT.json
    assert turn_ok(url, {"text": "after", "render": "text"})["turn"] == 1


def test_page_in_headless_chromium(served, trained, tmp_path):
    """The page in Debian's chromium. A text-only turn; then a new conversation: the same words with an
    uploaded wav and mp4 (a longer prompt: the uploads reached the model) and an avatar picked (the page
    shows the one the server spoke the reply as), a non-empty reply, audio with a duration, a playable mp4;
    a second turn's history holds the first. Screenshot kept."""
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        from helpers import skip_or_fail

        skip_or_fail("needs Debian's chromium and chromium-driver (apt-get install -y chromium "
                     "chromium-driver; `make install` does it as root)")
    webdriver = require("selenium.webdriver", "drives the browser (the test extra)")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=900,1250",
                "--autoplay-policy=no-user-gesture-required", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(options=opts, service=service)
    url, _, _ = served
    media = trained[1]
    said = "I lost my job today."

    def text(element_id: str) -> str:
        return driver.find_element(By.ID, element_id).text

    def send(words: str, answered: str) -> None:
        driver.find_element(By.ID, "text").send_keys(words)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: text("status").startswith(answered))

    def prompt_tokens() -> int:
        m = re.fullmatch(r"prompt: (\d+) tokens", text("prompt"))
        assert m, text("prompt")
        return int(m.group(1))

    try:
        driver.get(url + "/")
        wait = WebDriverWait(driver, 240)
        wait.until(lambda d: text("status") == "ready")
        Select(driver.find_element(By.ID, "render")).select_by_value("text")
        send(said, "turn 1 answered")
        plain = prompt_tokens()
        driver.find_element(By.ID, "reset").click()
        wait.until(lambda d: text("status") == "new conversation")
        Select(driver.find_element(By.ID, "render")).select_by_value("avatar")
        Select(driver.find_element(By.ID, "age")).select_by_value("elderly")
        Select(driver.find_element(By.ID, "gender")).select_by_value("male")
        Select(driver.find_element(By.ID, "timbre")).select_by_value("low")
        for kind, name in (("audio", "diatest1utt2_7.wav"), ("video", "diatest1utt2_7.mp4")):
            driver.find_element(By.ID, f"{kind}-file").send_keys(str(media / name))
            wait.until(lambda d, kind=kind, name=name: text(f"{kind}-in") == name)  # read into the body
        send(said, "turn 1 answered")
        assert prompt_tokens() > plain  # the same words, with the <Aud>/<Vid> rows of the uploads
        assert text("avatar") == "listener avatar: elderly/male/low (pinned)"
        assert text("reply").strip(), "empty reply"
        wait.until(lambda d: d.execute_script("return document.getElementById('audio').duration > 0"))
        wait.until(lambda d: d.execute_script("const v = document.getElementById('video');"
                                              "return v.readyState >= 2 && v.duration > 0"))
        assert driver.execute_script("return document.getElementById('video').videoWidth") > 0
        assert "decode" in text("timings")
        send("And I am scared.", "turn 2 answered")
        items = driver.execute_script("return [...document.querySelectorAll('#history li')]"
                                      ".map(li => li.textContent)")
        assert len(items) == 4 and items[0] == f"you:{said}", items
        wait.until(lambda d: d.execute_script("return document.getElementById('audio').duration > 0"))
        wait.until(lambda d: d.execute_script("return document.getElementById('video').readyState >= 3"))
        time.sleep(0.5)  # the controls repaint
        shot = tmp_path / "serve.png"
        driver.save_screenshot(str(shot))
        if os.environ.get("EMPATHEIA_SCREENSHOT"):  # how docs/serve.png was made
            shutil.copy(shot, os.environ["EMPATHEIA_SCREENSHOT"])
        assert shot.stat().st_size > 1000
    finally:
        driver.quit()


def test_serve_flag_errors_are_one_line(cli_env, tmp_path):
    """Before it listens, serve fails like every command: one `error:` line, exit 2, no traceback."""
    from test_cli import assert_user_error

    cases = {("serve",): ["serve needs --ckpt"], ("serve", "--ckpt", tmp_path / "gone"): ["--ckpt", "gone"],
             ("serve", "--ckpt", tmp_path, "--port", "70000"): ["--port"]}
    with cf.ThreadPoolExecutor(len(cases)) as pool:  # three interpreters starting at once: less wall time
        done = dict(zip(cases, pool.map(lambda args: cli(cli_env, *args), cases), strict=True))
    for args, names in cases.items():
        assert_user_error(done[args], *names)
