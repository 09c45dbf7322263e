"""The Ray paths end to end on one GPU, in one device call: data, Ray Train, generation, evaluation, Ray Serve.

    python3 bench/gpu_e2e.py $OUT                         # the lent GPU machine; the call carries .device_bundle
    tools/private_netns.sh .venv/bin/python bench/gpu_e2e.py OUTDIR --cpu     # the same steps here, on CPU

Run from the repository root. On the GPU machine it first unpacks .device_bundle/wheels.tar.xz (made here by
tools/device_bundle.py: Ray, mlflow-skinny, bpeasy, lm-eval, for the image's Python 3.12) and installs it into
<work>/site with pip --no-index --no-deps; with --cpu it runs in the interpreter that runs it (this repository's
.venv) and installs nothing. Then, each step timed, with a timeout, its output appended to <OUT>/e2e.log, and the
run going on after a failure (a step whose input failed is skipped):

1. imports: torch (and whether it sees a GPU), Ray (data, serve, train.torch, the dashboard's state API), the
   MLflow SQLite store, bpeasy, lm-eval and this package's training, serving and lm-eval modules, each tried, all
   failures named;
2. ray_head: a local Ray head on 127.0.0.1 with token authentication (huginn_ray.cluster.local_ray.LocalRayHead)
   and `--num-gpus 1` (0 with --cpu), checked through ray.cluster_resources(); every later job joins it through
   RAY_ADDRESS, and it is stopped, by its process group, at the end;
3. tokenizer, 4. prepare: the demo data of `make demo` (configs/data/demo.yaml: Python's own standard library,
   no network) into <work>/data;
5. train: jobs/train.py on configs/train/tiny_cpu.yaml with one worker on the GPU (scaling.use_gpu=true,
   precision auto = bf16-mixed) for --steps steps: the loss falls (first against last value MLflow recorded),
   a checkpoint is written, the MLflow run is FINISHED;
6. generate: jobs/generate.py at 16 iterations on the device;
7. evaluate: jobs/evaluate.py's depth scaling on the validation shards (Ray Data, one replica on the GPU);
8. serve: jobs/serve.py on the device, four concurrent requests (a completion, a streamed completion, a chat
   completion, another completion), then SIGINT: it must exit 0;
9. gsm8k: jobs/evaluate.py's GSM8k recipe (lm-eval) on 2 problems of the shipped sample at depths 4 and 8, one
   Ray Data replica on the device.

Writes to OUT (at most 5 files): summary.txt (the table printed at the end), e2e.log (every step's output),
depth_scaling.csv, serve_responses.json, and ray_logs.tar.gz (Ray's session logs) when a step failed. No step
starts once --budget-s (540 s) is spent, so the summary comes back from a device call of 10 minutes. The demo
model is raven-tiny: on 2 shared CPU cores the steps took 100 to 150 s (the training 32 to 46 s); on the GPU machine add
about 10 s for the bundle's install (the GPU timings are not measured yet). The device call:
`python3 bench/gpu_e2e.py $OUT`, carry [".device_bundle"], timeout_s 600, after `python3 tools/device_bundle.py`
here (about 3 minutes).
Exit status 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / ".device_bundle" / "wheels.tar.xz"
H100_BF16_FLOPS = 989e12  # dense bf16 peak of one H100 SXM, for the training's MFU figure
SERVE_PROMPTS = [
    ("completion", {"prompt": "def main(", "max_tokens": 16}),
    ("streamed completion", {"prompt": "import json\n", "max_tokens": 16, "stream": True}),
    ("chat completion", {"messages": [{"role": "user", "content": "What does `json.dumps` do?"}], "max_tokens": 16}),
    ("completion", {"prompt": "class ", "max_tokens": 16}),
]


@dataclass
class Step:
    name: str
    status: str  # ok, FAILED, TIMEOUT, skipped
    seconds: float
    detail: str


class Run:
    """The steps' bookkeeping: the budget, the log, the results that make the summary."""

    def __init__(self, out: Path, work: Path, budget_s: float):
        self.out, self.work = out, work
        self.deadline = time.monotonic() + budget_s
        self.log = out / "e2e.log"
        self.steps: list[Step] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")

    def passed(self, *names: str) -> bool:
        return all(any(s.name == n and s.status == "ok" for s in self.steps) for n in names)

    def record(self, name: str, status: str, seconds: float, detail: str) -> Step:
        step = Step(name, status, seconds, detail)
        self.steps.append(step)
        print(f"[e2e] {name}: {status} in {seconds:.1f}s: {detail}", flush=True)
        return step

    def time_left(self, limit_s: float) -> float:
        return min(limit_s, self.deadline - time.monotonic())

    def command(self, name: str, argv: list[str], limit_s: float, needs: tuple[str, ...] = ()) -> tuple[str, str]:
        """Run argv in its own session with the step's timeout (within the budget); its output goes to e2e.log.
        Returns (status, output); the caller records the step."""
        if not self.passed(*needs):
            return "skipped", f"needs {', '.join(needs)}"
        timeout = self.time_left(limit_s)
        if timeout < 10:
            return "skipped", "budget spent"
        with tempfile.TemporaryFile("w+") as output:
            process = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                status = "ok" if process.wait(timeout=timeout) == 0 else f"FAILED (exit {process.returncode})"
            except subprocess.TimeoutExpired:
                stop_group(process)
                status = f"TIMEOUT ({timeout:.0f}s)"
            output.seek(0)
            text = output.read()
        self.append_log(name, argv, text)
        if status != "ok":
            print("\n".join(text.splitlines()[-15:]), flush=True)
        return status, text

    def append_log(self, name: str, argv: list[str], text: str) -> None:
        with open(self.log, "a") as log:
            log.write(f"\n===== {name}: {' '.join(argv)}\n{text}")

    def summary(self) -> str:
        width = max(len(s.name) for s in self.steps)
        lines = [f"{'step':<{width}}  {'status':<20} {'seconds':>8}  detail"]
        lines += [f"{s.name:<{width}}  {s.status:<20} {s.seconds:>8.1f}  {s.detail}" for s in self.steps]
        return "\n".join(lines)


def stop_group(process: subprocess.Popen, signum: int = signal.SIGTERM, wait_s: float = 15.0) -> None:
    """signum to the process's group, SIGKILL after wait_s."""
    for sig, timeout in ((signum, wait_s), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue


def install_bundle(run: Run) -> None:
    """The bundle's wheels into <work>/site, first on this process's path and on the jobs' PYTHONPATH."""
    start = time.monotonic()
    site, wheels = run.work / "site", run.work / "wheels"
    if not BUNDLE.is_file():
        run.record("install", "FAILED", 0.0, f"no {BUNDLE.relative_to(REPO)}: run tools/device_bundle.py here and "
                                             f"carry .device_bundle")
        return
    with tarfile.open(BUNDLE) as tar:
        tar.extractall(wheels, filter="data")
    status, _ = run.command("install", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                        "--no-compile", "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))],
                            limit_s=180)
    shutil.rmtree(wheels, ignore_errors=True)
    sys.path[:0] = [str(site), str(REPO)]
    run.env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), run.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ["PYTHONPATH"] = run.env["PYTHONPATH"]  # the Ray head's processes start from this environment
    # the image's own packages against the bundle's requirements (a version the bundle would have to carry)
    _, check = run.command("pip check", [sys.executable, "-m", "pip", "check"], limit_s=60)
    conflicts = [line for line in check.splitlines() if " requires " in line or " has requirement " in line]
    # a requirement on a distribution the bundle leaves out on purpose (tools/device_bundle.py's LEFT_OUT)
    missing = [re.search(r" requires (\S+), which is not installed", line) for line in conflicts]
    left_out = [match for match in missing if match and match[1] in bundle_left_out()]
    count = len(list(site.glob("*.dist-info")))
    run.record("install", status, time.monotonic() - start, f"{count} distributions into {site}; pip check: "
                                                             f"{len(conflicts) - len(left_out)} conflicts, "
                                                             f"{len(left_out)} left out on purpose (e2e.log)")


def bundle_left_out() -> set[str]:
    """The distributions tools/device_bundle.py leaves out on purpose (nothing the jobs load)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from device_bundle import LEFT_OUT
    finally:
        sys.path.remove(str(REPO / "tools"))
    return set(LEFT_OUT)


IMPORTS = """
import importlib, importlib.metadata as md, sys
modules = ["torch", "bpeasy", "ray", "ray.data", "ray.serve", "ray.train.torch", "ray.dashboard.modules.state",
           "mlflow.store.tracking.sqlalchemy_store", "lm_eval", "huginn_ray.train.loop", "huginn_ray.serve.app",
           "huginn_ray.eval.lm_eval"]
missing = []
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as err:
        missing.append(f"{name}: {type(err).__name__}: {err}")
versions = {}
for name in ("torch", "ray", "mlflow-skinny", "numpy", "pyarrow", "pandas", "protobuf", "grpcio", "aiohttp",
             "pydantic", "fastapi"):
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        versions[name] = "missing"
print(f"python {sys.version.split()[0]}; " + ", ".join(f"{n} {v}" for n, v in versions.items()))
if "torch" in sys.modules:
    import torch
    print(f"cuda available: {torch.cuda.is_available()}"
          + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""))
    if sys.argv[1] == "cuda" and not torch.cuda.is_available():
        missing.append("torch sees no GPU")
if missing:
    sys.exit("cannot import: " + "; ".join(missing))
"""


def check_imports(run: Run, device: str) -> None:
    start = time.monotonic()
    status, text = run.command("imports", [sys.executable, "-c", IMPORTS, device], limit_s=120)
    detail = " / ".join(text.strip().splitlines()[-2:]) if status == "ok" else last_line(text, 1000)
    run.record("imports", status, time.monotonic() - start, detail)


def start_ray_head(run: Run, gpus: int):
    """The local Ray head every job joins (huginn_ray.cluster.local_ray.LocalRayHead: token authentication, its
    own session); None when it did not start."""
    start = time.monotonic()
    (run.work / "ray").mkdir(exist_ok=True)
    try:  # also when a module of the imports step failed: what runs without it still shows what works
        from huginn_ray.cluster.local_ray import LocalRayHead
        from huginn_ray.console import QUIET_ENV

        head = LocalRayHead(str(run.work / "ray"), startup_timeout_s=run.time_left(120), num_gpus=gpus)
    except Exception as err:  # noqa: BLE001 - reported in the summary, the run goes on to its end
        run.record("ray_head", "FAILED", time.monotonic() - start, f"{type(err).__name__}: {str(err)[-300:]}")
        return None
    # LocalRayHead put its token and huginn_ray.console's settings into os.environ, which the jobs' environment
    # was copied from before: without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 a client given 127.0.0.1 dials the
    # machine's routable address instead, where this head does not answer (the H100's 192.0.2.2)
    run.env.update({k: os.environ[k] for k in (*QUIET_ENV, "RAY_AUTH_TOKEN")})
    run.env["RAY_ADDRESS"] = head.address
    status, text = run.command("ray_head", [sys.executable, "-c", RESOURCES], limit_s=60)
    found = re.search(r"^RESOURCES (.*)$", text, re.M)
    offered = json.loads(found.group(1)) if status == "ok" and found else {}
    if status == "ok" and offered.get("GPU", 0) != gpus:
        status = "FAILED (GPUs)"
    detail = (f"{head.address}, offers {offered.get('CPU', 0):g} CPUs and {offered.get('GPU', 0):g} GPUs "
              f"(asked for {gpus})" if offered else last_line(text))
    run.record("ray_head", status, time.monotonic() - start, detail)
    return head


RESOURCES = """
import json, ray
ray.init()  # RAY_ADDRESS
print("RESOURCES", json.dumps(ray.cluster_resources()))
"""


def last_line(text: str, width: int = 300) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-width:] if lines else "no output"


def data_steps(run: Run) -> None:
    for name, job in (("tokenizer", "jobs/train_tokenizer.py"), ("prepare", "jobs/prepare_data.py")):
        start = time.monotonic()
        argv = [sys.executable, job, "--config", "configs/data/demo.yaml", f"output_dir={run.work / 'data'}"]
        needs = ("ray_head",) if name == "tokenizer" else ("ray_head", "tokenizer")
        status, text = run.command(name, argv + (["--quiet"] if name == "prepare" else []), limit_s=240, needs=needs)
        run.record(name, status, time.monotonic() - start, last_line(text))


def train(run: Run, device: str, steps: int) -> None:
    start = time.monotonic()
    data = run.work / "data"
    overrides = [f"out_dir={run.work / 'train'}", f"data.data_dir={data / 'shards'}",
                 f"data.tokenizer_path={data / 'tokenizer'}", f"max_steps={steps}", "scaling.num_workers=1",
                 f"scaling.use_gpu={'true' if device == 'cuda' else 'false'}", "log_step_interval=5",
                 f"checkpoint.save_step_interval={max(steps // 2, 1)}", f"eval_step_interval={max(steps // 2, 1)}"]
    if device == "cuda":
        overrides.append(f"peak_flops_per_device={H100_BF16_FLOPS:g}")
    status, text = run.command("train", [sys.executable, "jobs/train.py", "--config", "configs/train/tiny_cpu.yaml",
                                         *overrides], limit_s=360, needs=("prepare",))
    if status != "ok":
        run.record("train", status, time.monotonic() - start, last_line(text))
        return
    problems, facts = [], []
    checkpoint = re.search(r"^\[huginn\] checkpoint: (\S+)", text, re.M)
    if checkpoint is None or not Path(checkpoint.group(1)).is_dir():
        problems.append("no checkpoint directory named on the console")
    else:
        facts.append(f"checkpoint {Path(checkpoint.group(1)).name}")
    losses, run_status = mlflow_losses(run.work / "train" / "mlflow" / "mlflow.db")
    if len(losses) < 2 or not losses[-1][1] < losses[0][1]:
        problems.append(f"loss did not fall: {losses}")
    else:
        facts.append(f"loss {losses[0][1]:.3f} at step {losses[0][0]} -> {losses[-1][1]:.3f} at step {losses[-1][0]}")
    if run_status != "FINISHED":
        problems.append(f"MLflow run {run_status}")
    else:
        facts.append("MLflow run FINISHED")
    precision = re.search(r"workers, model [^,]+, (\S+)", text)
    facts.append(precision.group(1) if precision else "precision not printed")
    run.record("train", "FAILED (checks)" if problems else "ok", time.monotonic() - start,
               "; ".join(problems + facts))


def mlflow_losses(db: Path) -> tuple[list[tuple[int, float]], str]:
    """The training loss by step, and the run's status, from the run's SQLite store (one run in it)."""
    if not db.is_file():
        return [], "missing"
    with sqlite3.connect(db) as connection:
        losses = connection.execute("SELECT step, value FROM metrics WHERE key = 'loss' ORDER BY step").fetchall()
        statuses = connection.execute("SELECT status FROM runs").fetchall()
    return losses, ",".join(s for (s,) in statuses) or "no run"


def generate(run: Run, device: str) -> None:
    start = time.monotonic()
    status, text = run.command("generate", [
        sys.executable, "jobs/generate.py", "--checkpoint", str(run.work / "train"), "--tokenizer",
        str(run.work / "data" / "tokenizer"), "--prompt", "def main(", "--num-steps", "16", "--max-new-tokens", "24",
        "--device", device], limit_s=180, needs=("train",))
    speed = re.search(r"^\[huginn\] (\d+ tokens in .*?tokens/s)", text, re.M)
    run.record("generate", status, time.monotonic() - start,
               speed.group(1) if status == "ok" and speed else last_line(text))


def evaluate(run: Run, device: str) -> None:
    start = time.monotonic()
    out = run.work / "eval"
    status, text = run.command("evaluate", [
        sys.executable, "jobs/evaluate.py", "--checkpoint", str(run.work / "train"), "--data-dir",
        str(run.work / "data" / "shards"), "--out", str(out), "--depths", "1,4,16,32", "--max-rows", "8",
        "--device", device], limit_s=240, needs=("train",))
    table = out / "depth_scaling.csv"
    if status == "ok" and table.is_file():
        shutil.copy(table, run.out / "depth_scaling.csv")
        rows = table.read_text().strip().splitlines()
        header = rows[0].split(",")
        losses = [dict(zip(header, row.split(","))) for row in rows[1:]]
        detail = "loss by depth: " + ", ".join(f"{r['depth']}: {float(r['loss']):.3f}" for r in losses)
    else:
        status = status if status != "ok" else "FAILED (no csv)"
        detail = last_line(text)
    run.record("evaluate", status, time.monotonic() - start, detail)


def gsm8k(run: Run, device: str) -> None:
    """jobs/evaluate.py's GSM8k recipe (lm-eval, 8-shot chat prompts) on 2 problems of the shipped sample at
    depths 4 and 8, one replica on the device: the sweep's JSON is written and has both depths."""
    from huginn_ray.eval.gsm8k import SAMPLE_DATA

    start = time.monotonic()
    out = run.work / "gsm8k"
    status, text = run.command("gsm8k", [
        sys.executable, "jobs/evaluate.py", "--checkpoint", str(run.work / "train"), "--gsm8k", str(SAMPLE_DATA),
        "--sweep", "4,8", "--limit", "2", "--out", str(out), "--replicas", "1", "--device", device,
        f"tokenizer={run.work / 'data' / 'tokenizer'}", "max_gen_toks=16"], limit_s=240, needs=("train",))
    report = out / "gsm8k_depth_sweep.json"
    if status == "ok" and report.is_file():
        sweep = json.loads(report.read_text())
        depths, settings = sweep["depths"], sweep["settings"]
        detail = (f"depths {', '.join(sorted(depths, key=int))}, {settings['samples']} problems each, "
                  f"{settings['replicas']} replica on {settings['device']}, {settings['dtype']}")
        status = status if sorted(depths, key=int) == ["4", "8"] else "FAILED (depths)"
    else:
        status = status if status != "ok" else "FAILED (no report)"
        detail = last_line(text)
    run.record("gsm8k", status, time.monotonic() - start, detail)


def serve(run: Run, device: str) -> None:
    """jobs/serve.py, four concurrent requests, SIGINT; every request answered and the server's exit 0."""
    start = time.monotonic()
    if not run.passed("train"):
        run.record("serve", "skipped", 0.0, "needs train")
        return
    if run.time_left(180) < 60:
        run.record("serve", "skipped", 0.0, "budget spent")
        return
    from huginn_ray.cluster.local_ray import free_port

    port = free_port()
    argv = [sys.executable, "jobs/serve.py", "--checkpoint", str(run.work / "train"), "--tokenizer",
            str(run.work / "data" / "tokenizer"), "--device", device, "--host", "127.0.0.1", "--port", str(port)]
    log_path = run.work / "serve.log"
    deadline = time.monotonic() + run.time_left(180)
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, cwd=REPO, env=run.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    problems, answers, exit_code = [], [], None
    try:
        while "[huginn] serving" not in log_path.read_text():
            if process.poll() is not None or time.monotonic() > deadline - 30:
                problems.append("the server did not come up" + (f" (exit {process.returncode})"
                                                                 if process.returncode is not None else ""))
                break
            time.sleep(0.5)
        else:
            ready_s = time.monotonic() - start
            answers = ask_concurrently(port, timeout_s=max(deadline - time.monotonic() - 20, 10))
            problems += [f"request {i} ({a['kind']}): {a['problem']}" for i, a in enumerate(answers) if a["problem"]]
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            exit_code = process.wait(timeout=60)
            if exit_code != 0:
                problems.append(f"exit {exit_code} after SIGINT")
        except subprocess.TimeoutExpired:
            problems.append("still running 60 s after SIGINT")
    finally:
        stop_group(process)
        run.append_log("serve", argv, log_path.read_text())
    (run.out / "serve_responses.json").write_text(json.dumps(answers, indent=1))
    if problems:
        run.record("serve", "FAILED", time.monotonic() - start, "; ".join(problems)[:400])
        return
    tokens = sum(a["tokens"] for a in answers)
    run.record("serve", "ok", time.monotonic() - start,
               f"ready in {ready_s:.0f}s; 4 concurrent requests answered ({tokens} tokens), exit 0 after SIGINT")


def ask_concurrently(port: int, timeout_s: float) -> list[dict]:
    answers: list[dict] = [{} for _ in SERVE_PROMPTS]

    def ask(i: int, kind: str, body: dict) -> None:
        answers[i] = {"kind": kind, "request": body, **ask_one(port, kind, body, timeout_s)}

    threads = [threading.Thread(target=ask, args=(i, kind, body)) for i, (kind, body) in enumerate(SERVE_PROMPTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def ask_one(port: int, kind: str, body: dict, timeout_s: float) -> dict:
    """One request: its text, its completion tokens (streamed: chunks with text), and what was wrong, if anything."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if body.get("stream"):
                events = [line[len(b"data: "):].decode().strip() for line in response if line.startswith(b"data: ")]
                if not events or events[-1] != "[DONE]":
                    return {"text": "", "tokens": 0, "problem": f"stream did not end with [DONE]: {events[-3:]}"}
                chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
                text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in chunks)
                return {"text": text, "tokens": len(chunks), "problem": None if chunks else "no chunks"}
            answer = json.loads(response.read())
    except Exception as err:  # noqa: BLE001 - the summary names it
        return {"text": "", "tokens": 0, "problem": f"{type(err).__name__}: {err}"}
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    tokens = answer["usage"]["completion_tokens"]
    return {"text": text, "tokens": tokens, "problem": None if tokens > 0 else "no completion tokens"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where summary.txt, e2e.log and the small results go ($OUT)")
    parser.add_argument("--cpu", action="store_true",
                        help="the same steps on CPU in this interpreter (its Ray and MLflow), no bundle, no GPU")
    parser.add_argument("--work", type=Path, help="working directory (default: a new /tmp/hr_e2e_*)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (the demo shards hold about 150)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="no step starts after this many seconds, so the summary is written in time")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the loss is compared between two logged steps), got {args.steps}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="hr_e2e_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    run = Run(args.out.resolve(), work.resolve(), args.budget_s)
    run.log.write_text("")
    device = "cpu" if args.cpu else "cuda"
    print(f"[e2e] {device}, work directory {run.work}, output {run.out}", flush=True)
    if args.cpu:
        print(f"[e2e] --cpu: nothing to install, {sys.executable}'s own packages", flush=True)
    else:
        install_bundle(run)
    check_imports(run, device)
    head = start_ray_head(run, gpus=0 if args.cpu else 1)
    try:
        data_steps(run)
        train(run, device, args.steps)
        generate(run, device)
        evaluate(run, device)
        serve(run, device)
        gsm8k(run, device)
    finally:
        if head is not None:
            head.stop()
    ray_logs = run.work / "ray" / "session_latest" / "logs"
    if any(s.status not in ("ok", "skipped") for s in run.steps) and ray_logs.is_dir():
        with tarfile.open(run.out / "ray_logs.tar.gz", "w:gz") as tar:
            tar.add(ray_logs, arcname="logs")
        if (run.out / "ray_logs.tar.gz").stat().st_size > 15 * 2**20:
            (run.out / "ray_logs.tar.gz").unlink()  # over what a device call brings back
    table = run.summary()
    (run.out / "summary.txt").write_text(table + "\n")
    print(table, flush=True)
    return 0 if all(s.status == "ok" for s in run.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
