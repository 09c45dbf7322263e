"""A local stand-in for the Hugging Face Hub's HTTP API for dataset repos, with fault injection.

It serves what huggingface_hub's `dataset_info(files_metadata=True)` and `hf_hub_download` ask for:

    GET  /api/datasets/<owner>/<name>[/revision/<rev>]    repo info: sha, siblings (rfilename, size, blobId, lfs)
    HEAD /datasets/<owner>/<name>/resolve/<rev>/<path>    X-Repo-Commit, ETag, X-Linked-Size, Content-Length
    GET  /datasets/<owner>/<name>/resolve/<rev>/<path>    the bytes, with Range support (206 + Content-Range)

Files named `*.parquet` are served as LFS files (ETag = sha256), others as plain git blobs (ETag = git sha1),
so both of the client's verification paths are exercised. With `token` set, requests without
`Authorization: Bearer <token>` get 401.

Faults: 429 with Retry-After, 500, a dropped connection (socket closed before any response), and a truncated
body (full Content-Length, half the bytes; file GETs only). `script` maps a request kind ("info", "head", "get")
to faults served, in order, to the first requests of that kind; after that a seeded RNG picks one for a share
`fault_rate` of requests. Paths in `always_fail` get a 500 on every GET of their bytes (their HEAD works, so
the client fails fast instead of sleeping through its own metadata retries).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

FAULTS = ("429", "500", "drop", "truncate")


class HubRepo:
    def __init__(self, repo_id: str, files: dict[str, bytes], commit: str | None = None):
        self.repo_id = repo_id
        self.files = files
        self.commit = commit or hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()

    def sibling(self, path: str) -> dict:
        data = self.files[path]
        entry = {"rfilename": path, "size": len(data), "blobId": git_sha1(data)}
        if path.endswith(".parquet"):
            entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return entry

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if path.endswith(".parquet") else git_sha1(data)


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # injected faults break connections on purpose


class FakeHub:
    def __init__(self, repos: list[HubRepo], *, token: str | None = None, fault_rate: float = 0.0,
                 seed: int = 0, retry_after: int = 1, always_fail: set[str] = frozenset(),
                 script: dict[str, list[str]] | None = None):
        self.repos = {r.repo_id: r for r in repos}
        self.token = token
        self.fault_rate = fault_rate
        self.retry_after = retry_after
        self.always_fail = set(always_fail)
        self.script = {kind: list(faults) for kind, faults in (script or {}).items()}
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, str]] = []  # (method, path, outcome)
        self.server = _QuietServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def record(self, method: str, path: str, outcome: str) -> None:
        with self.lock:
            self.log.append((method, path, outcome))

    def draw_fault(self, kind: str) -> str | None:
        with self.lock:
            if self.script.get(kind):
                return self.script[kind].pop(0)
            if self.rng.random() < self.fault_rate:
                fault = self.rng.choice(FAULTS)
                return "500" if fault == "truncate" and kind != "get" else fault
        return None

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                url = urlparse(self.path)
                path = unquote(url.path)
                method = "HEAD" if head else "GET"
                if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    hub.record(method, path, "401")
                    return self._json(401, {"error": "Invalid credentials"}, head)
                info = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                resolve = re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if not info and not resolve:
                    hub.record(method, path, "404")
                    return self._json(404, {"error": "not found"}, head)
                repo = hub.repos.get((info or resolve).group(1))
                revision = (info.group(2) if info else resolve.group(2)) or "main"
                if repo is None or revision not in ("main", repo.commit):
                    hub.record(method, path, "404")
                    return self._json(404, {"error": "Repository or revision not found"}, head)
                file_path = resolve.group(3) if resolve else None
                if file_path is not None and file_path not in repo.files:
                    hub.record(method, path, "404")
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                kind = "info" if info else "head" if head else "get"
                fault = "500" if kind == "get" and file_path in hub.always_fail else hub.draw_fault(kind)
                hub.record(method, path, fault or "ok")
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return None
                if fault in ("429", "500"):
                    self.send_response(int(fault))
                    if fault == "429":
                        self.send_header("Retry-After", str(hub.retry_after))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if info:
                    return self._json(200, {"id": repo.repo_id, "sha": repo.commit, "private": False,
                                            "siblings": [repo.sibling(p) for p in sorted(repo.files)]}, head)
                return self._file(repo, file_path, head, truncate=fault == "truncate")

            def _json(self, status: int, body: dict, head: bool) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _file(self, repo: HubRepo, path: str, head: bool, truncate: bool) -> None:
                data = repo.files[path]
                start = 0
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if match and not head:
                    start = min(int(match.group(1)), len(data))
                body = data[start:]
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{repo.etag(path)}"')
                self.send_header("X-Repo-Commit", repo.commit)
                self.send_header("X-Linked-Size", str(len(data)))
                self.end_headers()
                if head:
                    return
                if truncate:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        return Handler


HUB_QUESTIONS = ["Tom has three red apples and buys seven more green apples at the market on Sunday; how many now?",
                 "A train leaves at noon and travels sixty miles per hour for three hours; how far does it go?"]
"""The test split's questions of `gsm8k_repo`."""


def _question_parquet(questions: list[str]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    answers = [f"Add up what the question gives to get the total it asks for. #### {i + 7}" for i in range(len(questions))]
    pq.write_table(pa.table({"question": questions, "answer": answers}), buf)
    return buf.getvalue()


def gsm8k_repo(questions: list[str] = HUB_QUESTIONS) -> HubRepo:
    """A dataset repo laid out as openai/gsm8k is on the Hub: `main/{test,train}-00000-of-00001.parquet` with
    `question` and `answer` columns, and a dataset card."""
    return HubRepo("openai/gsm8k", {"main/test-00000-of-00001.parquet": _question_parquet(questions),
                                    "main/train-00000-of-00001.parquet": _question_parquet(["a training question"]),
                                    "README.md": b"# GSM8k\n"})


def use_endpoint(monkeypatch, hub: FakeHub) -> None:
    """What HF_ENDPOINT=<the local server> does when huggingface_hub is imported: its endpoint and the file URL
    template built from it (a subprocess with the variable set: tests/test_data_hub_download.py)."""
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
    monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")


def web_config_against_hub(root, repo_id: str):
    """A data config under `root` with one local source of one document, decontaminated (mode drop) against the
    Hub dataset `repo_id` (config main); returns the config file's path."""
    (root / "web").mkdir()
    (root / "web" / "docs.jsonl").write_text('{"text": "a document"}\n')
    (root / "sources.yaml").write_text("- {name: web, local_dir: web, features: [text]}\n")
    config = root / "data.yaml"
    config.write_text(f"output_dir: {root / 'out'}\nsources: sources.yaml\n"
                      f"decontaminate: {{mode: drop, against: [{{hub: {repo_id}, config: main}}]}}\n")
    return config
