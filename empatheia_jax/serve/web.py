"""`empatheia serve`: one loaded model behind a web page and an HTTP API (docs/design.md "Serving").

- `POST /api/turn` takes one JSON object {conversation, text, audio, video, listener, render}: `audio` a
  base64 WAV, `video` a base64 mp4 (or webm, what a browser records), `listener` {age, gender, timbre},
  `render` "text" | "speech" | "avatar" (default). It answers {conversation, turn, reply, coe, emotion,
  listener (the pinned avatar the turn used, or null), prompt_length (the tokens the model read, media
  placeholders included), ..., timings {queue, decode, speech, video, total}, audio_url, video_url}.
  `conversation` null starts one; its id comes back, and the next turn sent with it sees this one in its
  history (the speaker's utterance and its media, then the reply), as `empatheia chat --history` would.
  `POST /api/reset` ends one.
- The turn itself is `turn.run_turn`, the code `empatheia chat` runs, on one model instance: turns run one
  at a time on one worker thread, behind `Limits.queue` waiting places; a turn that finds them all taken is
  answered 503 with Retry-After at once (memory never grows with the number of callers).
- Safe by default: uploads are checked before they queue (size, container magic bytes, decodability,
  duration) and refused with a 4xx naming the problem; uploads and replies are written only to a per-
  session folder under one temporary root, named by the server; a file URL is served only when the server
  wrote that name for that session (no user-supplied path is opened); JSON in, JSON out (no pickle);
  session folders are deleted on reset, on eviction (`Limits.max_conversations`, least recently used) and on
  shutdown; a conversation keeps its last `Limits.max_history` utterances (older media deleted).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import io
import json
import math
import shutil
import tempfile
import threading
import time
import uuid
import wave
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from empatheia_jax.data import schema
from empatheia_jax.serve import turn
from empatheia_jax.serve.decoding import Decoding
from empatheia_jax.serve.history import ChatInputError
from empatheia_jax.serve.prompt import PromptTooLongError

STATIC = Path(__file__).with_name("static")
MEDIA_TYPES = {".wav": "audio/wav", ".mp4": "video/mp4", ".webm": "video/webm"}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request and the server may hold (flags of `empatheia serve`)."""

    max_upload_bytes: int = 20 * 2**20
    max_media_seconds: float = 30.0
    max_text_chars: int = 4000
    queue: int = 4  # turns waiting behind the running one; one more gets 503
    max_conversations: int = 32
    max_history: int = 40  # utterances kept per conversation

    @property
    def max_body_bytes(self) -> int:
        """Two base64 uploads (4/3 of their bytes) plus the text and JSON around them."""
        return 2 * math.ceil(self.max_upload_bytes * 4 / 3) + 4 * self.max_text_chars + 65536


class RequestProblem(Exception):
    """A request refused with `status` and a message naming the problem (the page shows it as is)."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, dict(headers or {})


@dataclasses.dataclass
class Session:
    id: str
    folder: Path
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    turns: int = 0
    busy: bool = False
    closed: bool = False
    served: dict[str, Path] = dataclasses.field(default_factory=dict)  # URL name -> a file the server wrote
    last_used: float = dataclasses.field(default_factory=time.monotonic)


# A turn function: (text, audio path | None, video path | None, history, out stem, render, listener) -> the
# reply fields and {"audio": wav, "video": mp4} of the files it wrote. `replier_turn` is the real one.
TurnFn = Callable[..., dict[str, Any]]


def replier_turn(replier: turn.Replier, decoding: Decoding = Decoding()) -> TurnFn:
    """The turn function of a loaded model: `turn.run_turn` decoding every turn with `decoding` (the
    server's flags: budget, repetition controls, drawn replies)."""

    def run(*, text: str, audio: Path | None, video: Path | None, history: list[dict[str, Any]], out: Path,
            render: str, listener: dict[str, str] | None) -> dict[str, Any]:
        done = turn.run_turn(replier, text=text, audio=audio, video=video, history=history, out=out,
                             render=render, listener=listener, text_name="text", decoding=decoding)
        r = done.result
        return {
            "reply": r.reply, "text": r.text, "coe": r.coe, "emotion": r.emotion,
            "emotion_text": r.emotion_text,
            "profile": {k: r.profile.get(k, "") for k in ("age", "gender", "timbre")},
            "listener": listener,  # the avatar the reply is spoken and drawn as (None: the predicted one)
            "speaker_text": done.speaker_text, "input_transcripts": r.input_transcripts,
            "prompt_length": r.prompt_length, "new_tokens": len(r.input_ids) - r.prompt_length,
            "notes": [*r.notes, *done.speech_notes, *done.video_notes], "timings": dict(done.timings),
            "speech_seconds": done.speech_seconds, "frames": done.frames,
            "files": {"audio": done.wav, "video": done.mp4},
        }

    return run


class Server:
    """Sessions, the bounded turn queue and the input checks; `app()` is the FastAPI application."""

    def __init__(self, turn_fn: TurnFn, limits: Limits = Limits(), *, root: str | Path | None = None,
                 info: Mapping[str, Any] | None = None):
        self.turn_fn, self.limits, self.info = turn_fn, limits, dict(info or {})
        self.root = Path(tempfile.mkdtemp(prefix="empatheia-serve-", dir=root))
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(limits.queue + 1)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="empatheia-turn")
        self._in_flight = 0
        self._turn_seconds = 5.0  # running mean of a turn, for Retry-After

    # -- sessions ------------------------------------------------------------------------------------------

    def new_session(self) -> Session:
        with self._lock:
            while len(self.sessions) >= self.limits.max_conversations:
                idle = [s for s in self.sessions.values() if not s.busy]
                if not idle:
                    raise RequestProblem(503, "every conversation slot is busy; try again shortly",
                                         {"Retry-After": str(self.retry_after())})
                self._close(min(idle, key=lambda s: s.last_used))
            sid = uuid.uuid4().hex
            folder = self.root / sid
            folder.mkdir()
            session = self.sessions[sid] = Session(sid, folder)
            return session

    def session(self, sid: Any) -> Session:
        if sid is None or sid == "":
            return self.new_session()
        with self._lock:
            session = self.sessions.get(sid) if isinstance(sid, str) else None
        if session is None:
            raise RequestProblem(404, f"conversation {str(sid)[:64]!r} is unknown (ended, or evicted after "
                                      "inactivity): start a new conversation")
        session.last_used = time.monotonic()
        return session

    def reset(self, sid: Any) -> bool:
        with self._lock:
            session = self.sessions.get(sid) if isinstance(sid, str) else None
            if session is not None:
                self._close(session)
        return session is not None

    def _close(self, session: Session) -> None:
        """Forgets `session` (the lock held); its folder goes now, or when its running turn ends."""
        self.sessions.pop(session.id, None)
        session.closed = True
        if not session.busy:
            shutil.rmtree(session.folder, ignore_errors=True)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the queue -----------------------------------------------------------------------------------------

    def retry_after(self) -> int:
        return max(1, math.ceil(self._turn_seconds * (self.limits.queue + 1)))

    def queue_state(self) -> dict[str, int]:
        return {"in_flight": self._in_flight, "capacity": self.limits.queue + 1}

    # -- one turn ------------------------------------------------------------------------------------------

    def parse_turn(self, body: Any) -> dict[str, Any]:
        """The checked fields of a /api/turn body (no file written yet)."""
        if not isinstance(body, dict):
            raise RequestProblem(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - {"conversation", "text", "audio", "video", "listener", "render"})
        if unknown:
            raise RequestProblem(400, f"unknown field(s) {unknown}; allowed: conversation, text, audio, "
                                      "video, listener, render")
        text = body.get("text") or ""
        if not isinstance(text, str):
            raise RequestProblem(400, f"text must be a string, got {type(text).__name__}")
        if len(text) > self.limits.max_text_chars:
            raise RequestProblem(413, f"text: {len(text)} characters, over the {self.limits.max_text_chars}-"
                                      "character limit")
        render = body.get("render") or "avatar"
        if render not in turn.RENDERS:
            raise RequestProblem(400, f"render {render!r}: expected one of {', '.join(turn.RENDERS)}")
        media = {k: self._upload(body.get(k), k) for k in ("audio", "video")}
        if not text.strip() and media["audio"] is None:
            raise RequestProblem(400, "empty turn: give text, or audio (a .wav) to be transcribed")
        return {"text": text, "render": render, "listener": _listener(body.get("listener")), **media}

    def _upload(self, value: Any, kind: str) -> bytes | None:
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise RequestProblem(400, f"{kind} must be a base64 string, got {type(value).__name__}")
        if value.startswith("data:"):  # a data: URL, as a browser's FileReader writes it
            value = value.partition(",")[2]
        if len(value) > math.ceil(self.limits.max_upload_bytes * 4 / 3) + 4:
            raise RequestProblem(413, f"{kind}: over the {self.limits.max_upload_bytes / 2**20:g} MB "
                                      "upload limit")
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RequestProblem(400, f"{kind}: not valid base64 ({e})") from e
        if len(data) > self.limits.max_upload_bytes:
            raise RequestProblem(413, f"{kind}: {len(data) / 2**20:.1f} MB, over the "
                                      f"{self.limits.max_upload_bytes / 2**20:g} MB upload limit")
        return data

    def write_media(self, session: Session, n: int, audio: bytes | None, video: bytes | None
                    ) -> tuple[Path | None, Path | None]:
        """The uploads as files of the session (names the server chooses), after checking each decodes and
        lasts at most `max_media_seconds`; a refused one is deleted."""
        paths: list[Path | None] = []
        for kind, data in (("audio", audio), ("video", video)):
            if data is None:
                paths.append(None)
                continue
            check = _check_wav if kind == "audio" else _check_video
            suffix = check(data, self.limits.max_media_seconds)
            path = session.folder / f"turn{n}_in_{kind}{suffix}"
            path.write_bytes(data)
            if kind == "video":
                try:
                    _check_video_file(path, self.limits.max_media_seconds)
                except RequestProblem:
                    path.unlink(missing_ok=True)
                    if paths[0] is not None:
                        paths[0].unlink(missing_ok=True)
                    raise
            paths.append(path)
        return paths[0], paths[1]

    async def turn(self, body: Any) -> dict[str, Any]:
        fields = self.parse_turn(body)
        session = self.session(body.get("conversation"))
        if not self._slots.acquire(blocking=False):
            wait = self.retry_after()
            raise RequestProblem(503, f"the server is busy ({self.limits.queue + 1} turns running or "
                                      f"waiting); retry in {wait} s", {"Retry-After": str(wait)})
        try:
            with self._lock:
                if session.busy:
                    raise RequestProblem(409, "a turn of this conversation is still running; wait for its "
                                              "reply")
                session.busy = True
                session.turns += 1
                n = session.turns
        except RequestProblem:
            self._slots.release()
            raise
        try:
            audio, video = await asyncio.to_thread(self.write_media, session, n, fields["audio"],
                                                   fields["video"])
            queued = time.perf_counter()
            with self._lock:
                self._in_flight += 1
            job = self._worker.submit(self._run, session, n, fields, audio, video, queued)
        except BaseException:
            self._finish(session)
            raise
        # The slot is freed when the turn ends, not when this request does (a client that hangs up early
        # leaves its turn running: the bound holds).
        job.add_done_callback(lambda _: self._finish(session))
        return await asyncio.wrap_future(job)

    def _finish(self, session: Session) -> None:
        session.busy = False
        if session.closed:
            shutil.rmtree(session.folder, ignore_errors=True)
        self._slots.release()

    def _run(self, session: Session, n: int, fields: dict[str, Any], audio: Path | None, video: Path | None,
             queued: float) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            out = self.turn_fn(text=fields["text"], audio=audio, video=video, history=list(session.history),
                               out=session.folder / f"turn{n}_reply", render=fields["render"],
                               listener=fields["listener"])
        except ChatInputError as e:
            for p in (audio, video):
                if p is not None:
                    p.unlink(missing_ok=True)
            status = 413 if isinstance(e.__cause__, PromptTooLongError) else 422
            raise RequestProblem(status, str(e)) from e
        finally:
            with self._lock:
                self._in_flight -= 1
        elapsed = time.perf_counter() - start
        self._turn_seconds = 0.7 * self._turn_seconds + 0.3 * elapsed
        files = out.pop("files", {}) or {}
        urls = {}
        for kind, path in files.items():
            if path is not None:
                name = Path(path).name
                session.served[name] = Path(path)
                urls[f"{kind}_url"] = f"/api/files/{session.id}/{name}"
        self._remember(session, n, fields["text"] if fields["text"].strip() else out.get("speaker_text", ""),
                       audio, video, out.get("reply", ""))
        timings = {"queue": start - queued, **out.pop("timings", {}), "total": time.perf_counter() - queued}
        return {"conversation": session.id, "turn": n, **out, "timings": timings, "audio_url": None,
                "video_url": None, **urls, "history_length": len(session.history)}

    def _remember(self, session: Session, n: int, said: str, audio: Path | None, video: Path | None,
                  reply: str) -> None:
        """The turn joins the history; old utterances' media and replies older than the last two go."""
        session.history += [
            {"role": "speaker", "utterance": said, "audio": str(audio) if audio else None,
             "video": str(video) if video else None},
            {"role": "listener", "utterance": reply, "audio": None, "video": None},
        ]
        while len(session.history) > self.limits.max_history:
            gone = session.history.pop(0)
            for k in ("audio", "video"):
                if gone.get(k):
                    Path(gone[k]).unlink(missing_ok=True)
        for name, path in list(session.served.items()):
            if not name.startswith((f"turn{n}_", f"turn{n - 1}_")):
                path.unlink(missing_ok=True)
                session.served.pop(name)
        for path in session.folder.glob(f"turn{n - 2}_reply.*"):
            path.unlink(missing_ok=True)

    def file(self, sid: str, name: str) -> Path:
        with self._lock:
            session = self.sessions.get(sid)
        path = session.served.get(name) if session is not None else None
        if path is None or not path.is_file():
            raise RequestProblem(404, "no such file (replies older than the last two turns are deleted)")
        return path

    # -- the application -----------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI(title="Empatheia", docs_url=None, redoc_url=None, openapi_url=None)

        def problem(e: RequestProblem) -> JSONResponse:
            return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)

        async def read_json(request: Request) -> Any:
            length = request.headers.get("content-length")
            cap = self.limits.max_body_bytes
            if length is not None and length.isdigit() and int(length) > cap:
                raise RequestProblem(413, f"request body of {int(length) / 2**20:.1f} MB is over the "
                                          f"{cap / 2**20:.1f} MB limit (uploads: "
                                          f"{self.limits.max_upload_bytes / 2**20:g} MB each)")
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise RequestProblem(413, f"request body over the {cap / 2**20:.1f} MB limit")
                chunks.append(chunk)
            try:
                return json.loads(b"".join(chunks) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestProblem(400, f"the request body is not JSON ({e})") from e

        @app.get("/")
        async def index() -> FileResponse:
            return FileResponse(STATIC / "index.html", media_type="text/html")

        @app.get("/static/{name}")
        async def static(name: str) -> Any:
            files = {p.name: p for p in STATIC.iterdir() if p.is_file()}
            if name not in files:
                return problem(RequestProblem(404, "no such file"))
            return FileResponse(files[name])

        @app.get("/api/health")
        async def health() -> dict[str, Any]:
            return {"ok": True, **self.info, "queue": self.queue_state(), "sessions": len(self.sessions),
                    "limits": {"max_upload_mb": self.limits.max_upload_bytes / 2**20,
                               "max_media_seconds": self.limits.max_media_seconds,
                               "max_text_chars": self.limits.max_text_chars, "queue": self.limits.queue},
                    "listener_choices": {"age": list(schema.AGES), "gender": list(schema.GENDERS),
                                         "timbre": list(schema.TIMBRES)}}

        @app.post("/api/turn")
        async def api_turn(request: Request) -> Any:
            try:
                return await self.turn(await read_json(request))
            except RequestProblem as e:
                return problem(e)

        @app.post("/api/reset")
        async def api_reset(request: Request) -> Any:
            try:
                body = await read_json(request)
            except RequestProblem as e:
                return problem(e)
            sid = body.get("conversation") if isinstance(body, dict) else None
            return {"reset": self.reset(sid)}

        @app.get("/api/files/{sid}/{name}")
        async def files(sid: str, name: str) -> Any:
            try:
                path = self.file(sid, name)
            except RequestProblem as e:
                return problem(e)
            return FileResponse(path, media_type=MEDIA_TYPES.get(path.suffix, "application/octet-stream"))

        @app.exception_handler(Exception)
        async def unexpected(_: Request, e: Exception) -> JSONResponse:
            return JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, status_code=500)

        app.add_event_handler("shutdown", self.shutdown)
        return app


def _listener(value: Any) -> dict[str, str] | None:
    from empatheia_jax.serve.avatar import parse_listener

    if value is None or value == "":
        return None
    if not isinstance(value, dict) or set(value) != {"age", "gender", "timbre"}:
        raise RequestProblem(400, "listener must be an object {age, gender, timbre}, e.g. "
                                  '{"age": "young", "gender": "female", "timbre": "mid"}')
    try:
        return parse_listener(",".join(str(value[k]) for k in ("age", "gender", "timbre")), flag="listener")
    except ValueError as e:
        raise RequestProblem(400, str(e)) from e


def _check_wav(data: bytes, max_seconds: float) -> str:
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise RequestProblem(415, "audio: not a WAV file (no RIFF/WAVE header); send a .wav recording")
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            frames, rate = w.getnframes(), w.getframerate()
            if rate <= 0 or frames <= 0:
                raise ValueError("no samples")
            w.readframes(frames)
    except Exception as e:  # noqa: BLE001 - `wave` raises several kinds (even RuntimeError) on a bad file
        why = str(e) or type(e).__name__
        raise RequestProblem(422, f"audio: corrupt or unsupported WAV ({why}); send a PCM .wav") from e
    seconds = frames / rate
    if seconds > max_seconds:
        raise RequestProblem(413, f"audio: {seconds:.1f} s, over the {max_seconds:g} s limit")
    return ".wav"


def _check_video(data: bytes, max_seconds: float) -> str:
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return ".mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return ".webm"
    raise RequestProblem(415, "video: not an mp4 (or webm) file; send a talking-face .mp4")


def _check_video_file(path: Path, max_seconds: float) -> None:
    """Demuxes the whole file (no decoding beyond the first frame): a container PyAV cannot read, without a
    video stream or a decodable frame, or longer than `max_seconds`, is refused."""
    import av

    kind = path.suffix.lstrip(".")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise RequestProblem(422, f"video: the {kind} file has no video stream")
            stream = container.streams.video[0]
            end, decoded = 0.0, False
            for packet in container.demux(stream):
                if packet.pts is not None and packet.time_base is not None:
                    end = max(end, float((packet.pts + (packet.duration or 0)) * packet.time_base))
                if not decoded and packet.size:
                    decoded = bool(packet.decode())
            if not decoded:
                raise RequestProblem(422, f"video: no frame of the {kind} file decodes")
    except RequestProblem:
        raise
    except Exception as e:  # noqa: BLE001 - any PyAV/FFmpeg failure means an unreadable upload
        why = f"{type(e).__name__}: {e}"
        raise RequestProblem(422, f"video: corrupt or unreadable {kind} file ({why})") from e
    if end > max_seconds:
        raise RequestProblem(413, f"video: {end:.1f} s, over the {max_seconds:g} s limit")


__all__ = ["Limits", "RequestProblem", "Server", "replier_turn"]
