"""jobs/serve.py end to end: the OpenAI-compatible server on Ray Serve, on loopback in the private namespace.

One server with two replicas (its own private local Ray, as a user starts it, with an API key) answers 9
concurrent clients (completions and chat, streamed and not, through plain HTTP and the `openai` client, each with
the key) each exactly as `generate` answers that request alone at batch size 1, spreading them over both replicas
as its /stats counts them; answers 401 to every route without the key or with a wrong one; refuses bad requests
with HTTP 400 naming the field; frees the slot of a client that disconnects
mid-stream; drops from
/stats a replica whose process is killed, and answers /stats with 503 and then the same counts after its stats
board's process is killed; and stops on SIGINT with exit 0, leaving no process behind. Beside it, without Ray:
the board's liveness window on a fake clock, and the engine loop's idle reports and failed-request count.
"""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from huginn_ray.data.chat import render
from huginn_ray.data.tokenizer import train_tokenizer
from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.generation.generate import generate
from huginn_ray.model.pretrained import load_pretrained, save_pretrained
from isolation import free_port, private_namespace_problem

REPO = Path(__file__).resolve().parents[1]
MARKER = "HUGINN_TEST_SERVE"
API_KEY = "test-key-" + uuid.uuid4().hex
AUTHORIZED = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = ["def main(): return 1\n" * 50, "class A: pass\n" * 50, "Hello world, how are you today?\n" * 30]

# (route, body): every request returns its token ids and their core iterations (return_token_ids)
REQUESTS = [
    ("completions", dict(prompt="def main(", max_tokens=8, temperature=0, num_steps=6, exit_criterion="kl",
                         exit_threshold=5e-3, seed=1)),
    ("completions", dict(prompt="class A", max_tokens=10, temperature=0.8, seed=11, num_steps=5,
                         exit_criterion="latent-diff", exit_threshold=0.1, stream=True)),
    ("chat/completions", dict(messages=[{"role": "user", "content": "Hello, how are you?"}], max_tokens=6,
                              temperature=0, num_steps=4, seed=2)),
    ("chat/completions", dict(messages=[{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "def main"}], max_tokens=7, temperature=1.0,
                              top_k=20, seed=12, num_steps=6, exit_criterion="entropy-diff", exit_threshold=1e-2,
                              stream=True, stream_options={"include_usage": True})),
    ("completions", dict(prompt="Hello world", max_tokens=9, temperature=0.9, top_p=0.8, seed=13, num_steps=4,
                         cache="latest", warm_start=True, stream=True)),
    ("completions", dict(prompt=[5, 6, 7, 8, 9, 10], max_tokens=6, temperature=0, seed=3, num_steps=3)),
    ("chat/completions", dict(messages=[{"role": "user", "content": "class A"}], max_tokens=8, temperature=0.7,
                              seed=14, num_steps=5, exit_criterion="cosine", exit_threshold=1e-2)),
    ("completions", dict(prompt="return 1", max_tokens=12, temperature=0, seed=4, num_steps=8,
                         exit_criterion="argmax-stability", exit_threshold=2, stream=True)),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A raven-tiny saved as a model directory, with a tokenizer trained on a few lines beside it."""
    root = tmp_path_factory.mktemp("serve")
    torch.manual_seed(0)
    save_pretrained(RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=4096)).eval(), root / "model")
    train_tokenizer(TEXTS, 4096, root / "model" / "tokenizer")
    return root / "model"


def post(port: int, route: str, body: dict, headers: dict = AUTHORIZED) -> tuple[int, dict | list, str]:
    """(status, JSON body, the replica that answered), or for a stream (status, [chunk, ...], replica) up to
    `data: [DONE]`."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", f"/v1/{route}", json.dumps(body), {"Content-Type": "application/json", **headers})
    response = connection.getresponse()
    replica = response.getheader("Huginn-Replica")
    if not body.get("stream") or response.status != 200:
        return response.status, json.loads(response.read()), replica
    chunks = []
    for line in response:
        line = line.decode().strip()
        if line == "data: [DONE]":
            break
        if line:
            chunks.append(json.loads(line.removeprefix("data: ")))
    connection.close()
    return response.status, chunks, replica


def answer(route: str, body: dict, port: int) -> dict:
    """text, finish_reason, token_ids, core_iterations, usage and replica of a response, streamed or not."""
    status, got, replica = post(port, route, {**body, "return_token_ids": True})
    assert status == 200, got
    if not body.get("stream"):
        [choice] = got["choices"]
        text = choice["message"]["content"] if route.startswith("chat") else choice["text"]
        return dict(text=text, finish_reason=choice["finish_reason"], token_ids=choice["token_ids"],
                    core_iterations=choice["core_iterations"], usage=got["usage"], replica=replica)
    assert all(chunk["object"] == ("chat.completion.chunk" if route.startswith("chat") else "text_completion")
               for chunk in got)
    if body.get("stream_options", {}).get("include_usage"):
        *got, last = got
        assert last["choices"] == []
    choices = [chunk["choices"][0] for chunk in got]
    pieces = [c["delta"].get("content", "") if route.startswith("chat") else c["text"] for c in choices]
    return dict(text="".join(pieces), finish_reason=choices[-1]["finish_reason"],
                token_ids=[t for c in choices for t in c["token_ids"]],
                core_iterations=[s for c in choices for s in c["core_iterations"]],
                usage=last["usage"] if body.get("stream_options") else None, replica=replica)


def alone(model, tokenizer, route: str, body: dict) -> dict:
    """What `generate` gives the request alone at batch size 1 with its own seeded generator."""
    if route.startswith("chat"):
        ids, _ = render(body["messages"], tokenizer, add_generation_prompt=True)
        stop = tokenizer.token_to_id("<|end_turn|>")
    else:
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else (
            [tokenizer.token_to_id("<|begin_text|>")] + tokenizer.encode(prompt, add_special_tokens=False).ids)
        stop = tokenizer.token_to_id("<|end_text|>")
    result = generate(model, torch.tensor([ids]), body["max_tokens"], body["num_steps"], body.get("exit_criterion"),
                      body.get("exit_threshold"), cache=body.get("cache", "full"),
                      warm_start=body.get("warm_start", False), temperature=body["temperature"],
                      top_k=body.get("top_k"), top_p=body.get("top_p"), eos_token_id=stop,
                      generator=torch.Generator().manual_seed(body["seed"]))
    tokens, steps = result.tokens[0, len(ids):].tolist(), result.steps[0].tolist()
    if stop in tokens:
        tokens, steps = tokens[: tokens.index(stop) + 1], steps[: tokens.index(stop) + 1]
    text_ids = tokens[:-1] if tokens[-1] == stop else tokens
    return dict(text=tokenizer.decode(text_ids, skip_special_tokens=False),
                finish_reason="stop" if tokens[-1] == stop else "length", token_ids=tokens, core_iterations=steps,
                prompt_tokens=len(ids))


def stats(port: int, headers: dict = AUTHORIZED, route: str = "/stats") -> tuple[int, dict | str]:
    """(status, JSON body) of GET /stats (or another GET route); the body as text when it is not JSON (Serve's own
    error pages)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", route, headers=headers)
    response = connection.getresponse()
    body = response.read()
    return response.status, json.loads(body) if response.getheader("content-type") == "application/json" \
        else body.decode()


def stats_when(port: int, settled, statuses: list | None = None) -> dict:
    """/stats once it answers 200 and `settled(stats)` holds (the replicas report as requests end), or the last
    200 answer after 60 s; each answer's status is appended to `statuses` (with its body when not 200)."""
    deadline, served = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        status, body = stats(port)
        if statuses is not None:
            statuses.append(status if status == 200 else (status, body))
        if status == 200:
            served = body
            if settled(served):
                break
        time.sleep(0.2)
    return served


def processes_marked(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"{MARKER}={marker}".encode() in (entry / "environ").read_bytes():
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{entry.name}: {command}")
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_serve_spreads_concurrent_clients_over_replicas_answers_as_alone_and_stops_on_sigint(checkpoint, tmp_path):
    problem = private_namespace_problem()
    if problem:
        pytest.skip(f"starts a private local Ray and an HTTP server: {problem}")
    from openai import OpenAI
    from tokenizers import Tokenizer

    port, marker = free_port(), uuid.uuid4().hex
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAY_SERVE_DEPLOYMENT_ACTOR_HEALTH_CHECK_PERIOD_S"] = "1"  # Serve finds a dead StatsBoard in 1 s, not 10
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, str(REPO / "jobs" / "serve.py"), "--checkpoint", str(checkpoint),
                               "--port", str(port), "--replicas", "2", "--max-rows", "4", "--exit-wait-steps", "2",
                               "--admit-rows", "2", "--api-key", API_KEY,
                               "--device", "cpu"],
                              env={**env, MARKER: marker}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    # meanwhile: beyond loopback without a key, jobs/serve.py refuses by name before Ray starts
    open_server = subprocess.Popen([sys.executable, str(REPO / "jobs" / "serve.py"), "--checkpoint", str(checkpoint),
                                    "--host", "0.0.0.0", "--port", str(free_port())],
                                   env={key: value for key, value in env.items() if key != "HUGINN_API_KEY"},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        refused = open_server.communicate(timeout=120)
        assert open_server.returncode == 2 and "error: --host 0.0.0.0 is not a loopback address" in refused[1] \
            and "serving" not in refused[0], refused
        # up once serve.run returned with every replica running (one may answer before the other is up)
        deadline = time.monotonic() + 180
        while "[huginn] serving" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.3)
        tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer" / "tokenizer.json"))
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)

        def through_openai():  # the real client, a sampled completion with the depth fields in extra_body
            body = dict(prompt="def main", max_tokens=6, temperature=0.9, seed=21, num_steps=4)
            raw = client.completions.with_raw_response.create(
                model="model", prompt=body["prompt"], max_tokens=6, temperature=0.9, seed=21,
                extra_body={"num_steps": 4, "return_token_ids": True})
            response = raw.parse()
            [choice] = response.choices
            return body, dict(text=choice.text, finish_reason=choice.finish_reason, token_ids=choice.token_ids,
                              core_iterations=choice.core_iterations,
                              usage={key: getattr(response.usage, key) for key in
                                     ("prompt_tokens", "completion_tokens", "total_tokens", "core_iterations")},
                              replica=raw.headers["Huginn-Replica"])

        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS) + 1) as pool:
            running = [pool.submit(answer, route, body, port) for route, body in REQUESTS]
            from_openai = pool.submit(through_openai)
            answers = [future.result() for future in running]
            openai_body, openai_answer = from_openai.result()
        # both replicas took requests; each counts exactly those whose responses name it
        served = stats_when(port, lambda served: served["total"]["requests_finished"] == len(REQUESTS) + 1)
        answered_by = collections.Counter(got["replica"] for got in answers + [openai_answer])
        assert len(served["replicas"]) == 2 and len(answered_by) == 2, (served, answered_by)
        assert {replica: counts["requests_finished"] for replica, counts in served["replicas"].items()} == \
            answered_by, (served, answered_by)
        assert [counts["rows_in_flight"] for counts in served["replicas"].values()] == [0, 0], served

        model, threads = load_pretrained(checkpoint).eval(), torch.get_num_threads()
        torch.set_num_threads(1)  # as in the replica (Ray gives a 1-CPU actor one thread)
        try:
            expected = [alone(model, tokenizer, route, body) for route, body in REQUESTS + [("completions", openai_body)]]
        finally:
            torch.set_num_threads(threads)
        for (route, body), got, want in zip(REQUESTS + [("completions", openai_body)], answers + [openai_answer],
                                            expected):
            assert {key: got[key] for key in ("text", "finish_reason", "token_ids", "core_iterations")} == \
                {key: want[key] for key in ("text", "finish_reason", "token_ids", "core_iterations")}, (route, body)
            if got["usage"] is not None:
                assert got["usage"] == dict(prompt_tokens=want["prompt_tokens"],
                                            completion_tokens=len(want["token_ids"]),
                                            total_tokens=want["prompt_tokens"] + len(want["token_ids"]),
                                            core_iterations=sum(want["core_iterations"]))
        depths = [s for got in answers for s in got["core_iterations"]]
        assert min(depths) < max(depths)  # some tokens exited early

        # the chat stream through the openai client: the same text as the raw stream above
        route, body = REQUESTS[3]
        stream = client.chat.completions.create(
            model="model", messages=body["messages"], max_tokens=body["max_tokens"], temperature=1.0, seed=12,
            stream=True, extra_body={k: body[k] for k in ("top_k", "num_steps", "exit_criterion", "exit_threshold")})
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == answers[3]["text"]

        # without the key, or with another, every route answers 401 (the openai client's AuthenticationError)
        import openai

        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            status, got, _ = post(port, "completions", dict(prompt="x", max_tokens=1), headers)
            assert status == 401 and got["error"]["code"] == "invalid_api_key", got
            assert [stats(port, headers, route)[0] for route in ("/stats", "/v1/models")] == [401, 401]
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
        assert len(client.models.list().data) == 1

        # bad requests: 400 with OpenAI's error object naming the field
        for route, body, param in [
            ("completions", dict(prompt="x", exit_criterion="wisdom"), "exit_criterion"),
            ("completions", dict(prompt="x", max_tokens=300), "max_tokens"),
            ("completions", dict(prompt="x", seed=2**64), "seed"),  # beyond what a torch generator takes
            ("completions", dict(prompt="x", num_steps="4"), "num_steps"),
            ("completions", dict(prompt=""), "prompt"),
            ("chat/completions", dict(messages=[{"role": "robot", "content": "hi"}]), "messages"),
            ("completions", dict(prompt="x", best_of=3), "best_of"),
        ]:
            status, got, _ = post(port, route, body)
            assert status == 400 and got["error"]["param"] == param and param in got["error"]["message"], got

        # a client that disconnects mid-stream frees its row: its request is cancelled, not run to the end
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", json.dumps(dict(prompt="def", max_tokens=240, num_steps=32,
                                                                      stream=True, return_token_ids=True)),
                           {"Content-Type": "application/json", **AUTHORIZED})
        response = connection.getresponse()
        assert response.readline().startswith(b"data: ")
        connection.sock.shutdown(2)
        connection.close()
        served = stats_when(port, lambda served: served["total"]["requests_cancelled"] == 1 and
                            served["total"]["requests_finished"] == len(REQUESTS) + 2)["total"]  # + the chat stream
        assert served["requests_cancelled"] == 1 and served["requests_finished"] == len(REQUESTS) + 2, served
        assert served["rows_in_flight"] == 0, served

        # a replica whose process dies leaves /stats and its counters leave the total; Serve starts a replacement,
        # listed with its own (zero) counts once it reports
        before = stats_when(port, lambda served: True)["replicas"]
        [killed_pid, _] = sorted(int(line.split(":")[0]) for line in processes_marked(marker)
                                 if "ServeReplica" in line.split(":", 1)[1])
        os.kill(killed_pid, signal.SIGKILL)
        served = stats_when(port, lambda served: len(served["replicas"].keys() & before.keys()) == 1)
        [survivor] = served["replicas"].keys() & before.keys()
        assert served["replicas"][survivor] == before[survivor], (served, before)
        assert all(counts["requests_finished"] == 0 for replica, counts in served["replicas"].items()
                   if replica != survivor), served
        assert served["total"] == {key: sum(counts[key] for counts in served["replicas"].values())
                                   for key in before[survivor]}, served

        # the StatsBoard's process dies: Serve starts a new board, /stats answers 503 until it runs, then the
        # replicas' next reports fill it with the same counts
        [board_pid] = [int(line.split(":")[0]) for line in processes_marked(marker)
                       if "StatsBoard" in line.split(":", 1)[1]]
        os.kill(board_pid, signal.SIGKILL)
        statuses = []
        served = stats_when(port, lambda served: survivor in served["replicas"], statuses)
        assert served["replicas"][survivor] == before[survivor], (served, before)
        unavailable = [status for status in statuses if status != 200]
        assert unavailable and all(status == 503 and isinstance(body, dict) and
                                   "the stats board is restarting" in body["error"]["message"]
                                   for status, body in unavailable), statuses
    finally:
        if open_server.poll() is None:  # it should have refused to start
            open_server.kill()
        server.send_signal(signal.SIGINT)
        try:
            returncode = server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            raise AssertionError("jobs/serve.py did not stop on SIGINT: " + (tmp_path / "serve.log").read_text()[-3000:])
        finally:
            log.close()
            left = processes_marked(marker)
            for line in left:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert returncode == 0, (tmp_path / "serve.log").read_text()[-4000:]
    assert "shutting down" in (tmp_path / "serve.log").read_text()
    assert not left, left


def test_access_asks_a_key_beyond_loopback_and_compares_the_whole_header():
    from huginn_ray.serve.access import authorized, check_access, is_loopback

    assert [is_loopback(host) for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "0.0.0.0", "::",
                                           "10.0.0.1", "example.org")] == [True] * 4 + [False] * 4
    check_access("127.0.0.1", None)
    check_access("0.0.0.0", "k3y")
    with pytest.raises(ValueError, match=r"--host 0.0.0.0 is not a loopback address: .* pass --api-key KEY"):
        check_access("0.0.0.0", None)
    with pytest.raises(ValueError, match=r"--api-key \(or \$HUGINN_API_KEY\) is empty"):
        check_access("127.0.0.1", " ")
    assert authorized(None, None) and authorized("Bearer k3y", "k3y")
    assert not any(authorized(header, "k3y") for header in (None, "", "k3y", "Bearer k3", "Bearer k3yy", "bearer k3y"))


def test_stop_strings_end_the_text_before_them_and_hold_back_what_may_start_one(checkpoint):
    from tokenizers import Tokenizer

    from huginn_ray.serve.text import GeneratedText

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer" / "tokenizer.json"))
    ids = tokenizer.encode("Hello world, how are you today?", add_special_tokens=False).ids
    assert tokenizer.decode(ids) == "Hello world, how are you today?" and len(ids) > 6
    text = GeneratedText(tokenizer, stop_texts=("are yo", "zzz"))
    pieces = [text.add(token, is_stop_token=False) for token in ids]
    assert "".join(pieces) == "Hello world, how " and text.stopped
    assert pieces[:3] == ["Hello", " world", ","] and text.finish() == ""
    # "are", then "are you", may start "are you?": held back until the next token shows it does not
    text = GeneratedText(tokenizer, stop_texts=("are you?",))
    pieces = [text.add(token, is_stop_token=False) for token in ids] + [text.finish()]
    assert pieces == ["Hello", " world", ",", " how", " ", "", "are you today", "?", ""] and not text.stopped
    # a stop token ends the request and is not part of the text
    text = GeneratedText(tokenizer)
    end_text = tokenizer.token_to_id("<|end_text|>")
    assert [text.add(token, False) for token in ids[:2]] + [text.add(end_text, True)] == ["Hello", " world", ""]


def test_stats_board_lists_the_replicas_heard_from_lately_and_sums_only_them():
    from huginn_ray.serve.app import StatsBoard

    now = [100.0]
    board = StatsBoard(silent_after_s=5.0, clock=lambda: now[0])
    board.report("a", {"tokens": 3, "requests_finished": 1, "step_running_s": 0.0})
    board.report("b", {"tokens": 4, "requests_finished": 2, "step_running_s": 2.5})
    board.report("c", {"tokens": 5, "requests_finished": 0, "step_running_s": 9.0})
    now[0] = 104.0
    board.report("a", {"tokens": 7, "requests_finished": 2, "step_running_s": 1.5})
    board.forget("c")  # stopped cleanly: gone at once
    now[0] = 105.0  # b last reported 5 s ago: still live
    assert board.stats() == {"replicas": {"a": {"tokens": 7, "requests_finished": 2, "step_running_s": 1.5},
                                          "b": {"tokens": 4, "requests_finished": 2, "step_running_s": 2.5}},
                             "total": {"tokens": 11, "requests_finished": 4, "step_running_s": 2.5}}  # the longest
    now[0] = 105.5  # b silent for 5.5 s: dead, its counters leave the total
    assert board.stats() == {"replicas": {"a": {"tokens": 7, "requests_finished": 2, "step_running_s": 1.5}},
                             "total": {"tokens": 7, "requests_finished": 2, "step_running_s": 1.5}}
    assert list(board.replicas) == ["a"]
    now[0] = 200.0
    assert board.stats() == {"replicas": {}, "total": {}}


def test_engine_loop_reports_while_idle_and_counts_the_requests_a_failed_step_drops(checkpoint, monkeypatch):
    import asyncio

    from huginn_ray.generation.engine import Engine, EngineConfig
    from huginn_ray.generation.requests import Request
    from huginn_ray.serve.engine_loop import EngineLoop

    engine = Engine(load_pretrained(checkpoint).eval(), EngineConfig(max_rows=4, max_cache_bytes=2**26))
    reports = []
    loop = EngineLoop(engine, reports.append, report_every_s=0.01)
    try:
        deadline = time.monotonic() + 30  # idle: a report every 10 ms, not just the one at the start
        while len(reports) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        idle = dict(rows_in_flight=0, requests_waiting=0, cache_bytes_reserved=0, requests_finished=0,
                    requests_cancelled=0, requests_failed=0, tokens=0, loop_steps=0, step_running_s=0.0)
        assert len(reports) >= 5 and all(report == idle for report in reports), reports

        real_step = engine.step

        def fails_once():
            monkeypatch.setattr(engine, "step", real_step)
            raise RuntimeError("the device fell over")

        async def serve(requests):
            tickets = [loop.submit(request) for request in requests]
            ended = []
            for ticket in tickets:
                while not isinstance(event := await ticket.events.get(), Exception) and not event.finished:
                    pass
                ended.append(event if isinstance(event, Exception) else event.finish_reason)
            return ended

        monkeypatch.setattr(engine, "step", fails_once)
        ended = asyncio.run(serve([Request((5, 6, 7), 4, num_steps=2, seed=1), Request((8, 9), 3, num_steps=2)]))
        assert [str(event) for event in ended] == ["the engine's step failed: RuntimeError: the device fell over"] * 2
        assert asyncio.run(serve([Request((5, 6, 7), 4, num_steps=2, seed=1)])) == ["length"]
        deadline = time.monotonic() + 30
        while reports[-1]["requests_finished"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # 4 tokens of 2 core iterations each: the prefill and first token in the first step, then a decode step
        # per iteration, the last token read in a seventh; the failed step is not counted
        assert reports[-1] == dict(idle, requests_finished=1, requests_failed=2, tokens=4, loop_steps=7)

        # a step that runs long (a large model on a CPU) is reported while it runs, with its running time
        release = threading.Event()

        def long_step():
            monkeypatch.setattr(engine, "step", real_step)
            release.wait(60)
            return real_step()

        monkeypatch.setattr(engine, "step", long_step)
        since = len(reports)
        answered = []
        handler = threading.Thread(daemon=True, target=lambda: answered.append(asyncio.run(serve([Request((5, 6, 7), 1,
                                                                                             num_steps=2)]))))
        handler.start()
        deadline = time.monotonic() + 30
        while sum(report["step_running_s"] > 0 for report in reports[since:]) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        during = [report["step_running_s"] for report in reports[since:] if report["step_running_s"] > 0]
        assert len(during) >= 3 and during == sorted(during) and reports[-1]["loop_steps"] == 7, reports[-3:]
        release.set()
        handler.join(60)
        while reports[-1]["requests_finished"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert answered == [["length"]]  # 1 token: its prefill, in 1 loop step
        assert reports[-1] == dict(idle, requests_finished=2, requests_failed=2, tokens=5, loop_steps=8)
    finally:
        loop.stop()


def test_cuda_graphs_off_a_cuda_device_are_refused_before_ray_starts(checkpoint, capsys):
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_job", REPO / "jobs" / "serve.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.main(["--checkpoint", str(checkpoint), "--device", "cpu", "--cuda-graphs"]) == 2
    assert capsys.readouterr().err == "error: --cuda-graphs needs --device cuda, not cpu\n"
    settings = job.plan(argparse.Namespace(checkpoint=str(checkpoint), tokenizer=None, host="127.0.0.1", port=8000, replicas=1,
                                           device="cpu", dtype=None, max_rows=4, max_cache_gib=1.0,
                                           exit_wait_steps=0, admit_rows=1, cuda_graphs=False, compile=True, model_name=None,
                                           api_key=None))
    assert settings.engine.cuda_graphs is False  # --no-cuda-graphs reaches every replica's engine
    assert settings.engine.compile is True  # and --compile
