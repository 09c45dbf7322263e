"""Hub downloads through the real huggingface_hub client against a local Hub-compatible server with faults.

prepare_data runs in a subprocess with HF_ENDPOINT pointing at tests/data_hub_server.py (huggingface_hub reads
it at import) and HF_TOKEN set; it starts its own local Ray, whose tasks do the downloads.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_hub_server import FAULTS, HUB_QUESTIONS, FakeHub, HubRepo, gsm8k_repo, use_endpoint, \
    web_config_against_hub
from local_ray import module_ray

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_local_test_token_do_not_log_0123456789"
PARQUETS = [f"data/train-{i:05d}.parquet" for i in range(3)]


def _parquet(seed: int) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"content": [f"document {seed}-{i}: " + "word " * (i % 50) for i in range(40)],
                             "other": list(range(40))}), buf)
    return buf.getvalue()


def _repo() -> HubRepo:
    files = {path: _parquet(i) for i, path in enumerate(PARQUETS)}
    files["extra/notes.jsonl"] = "".join(json.dumps({"content": f"note {i} " * 7}) + "\n" for i in range(25)).encode()
    files["README.md"] = b"# a dataset card, not data\n"
    return HubRepo("acme/mix", files)


def _config(root: Path, max_attempts: int = 10) -> Path:
    (root / "sources.yaml").write_text("""
- name: mix
  address: acme/mix
  files: ["data/*.parquet", "extra/*.jsonl"]
  features: [content]
  license: cc-by-4.0
""")
    config = root / "data.yaml"
    config.write_text(f"""
output_dir: {root / 'out'}
sources: sources.yaml
download: {{max_in_flight: 2, max_attempts: {max_attempts}}}
local_ray: {{num_cpus: 2, object_store_mib: 128}}
""")
    return config


def _prepare(config: Path, hub: FakeHub, home: Path, stages: tuple[str, ...] = ("download", "staging")
             ) -> subprocess.CompletedProcess:
    temp_dir = tempfile.mkdtemp(prefix="hrdh_", dir="/tmp")
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "HF_HOME": str(home),
           "HF_HUB_DISABLE_TELEMETRY": "1", "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run(
            [sys.executable, str(ROOT / "jobs" / "prepare_data.py"), "--config", str(config),
             *[arg for stage in stages for arg in ("--stage", stage)], f"local_ray.temp_dir={temp_dir}"],
            env=env, capture_output=True, text=True, timeout=400)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _staged(root: Path) -> dict[str, bytes]:
    staging = root / "out" / "staging" / "mix"
    return {p.name: p.read_bytes() for p in sorted(staging.glob("*.parquet"))}


def _file_gets(hub: FakeHub, path: str) -> int:
    return sum(1 for method, p, _ in hub.log if method == "GET" and p.endswith("/" + path))


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    with FakeHub([_repo()], token=TOKEN) as hub:
        result = _prepare(_config(root), hub, root / "hf_home")
    assert result.returncode == 0, result.stderr[-3000:]
    return root, result


def test_download_stages_the_selected_files_and_records_provenance(clean_run):
    root, result = clean_run
    staged = _staged(root)
    assert list(staged) == ["00000.parquet", "00001.parquet", "00002.parquet", "00003.parquet"]
    texts = [t for name in staged for t in pq.read_table(root / "out" / "staging" / "mix" / name)["text"].to_pylist()]
    assert len(texts) == 3 * 40 + 25 and texts[0].startswith("document 0-0") and texts[-1].startswith("note 24")
    manifest = json.loads((root / "out" / "download" / "manifest.json").read_text())["sources"]["mix"]
    repo = _repo()
    assert manifest["commit"] == repo.commit
    recorded = {f["path"]: f for f in manifest["files"]}
    assert sorted(recorded) == sorted(PARQUETS + ["extra/notes.jsonl"])
    for path, entry in recorded.items():
        assert entry["size"] == len(repo.files[path])
        assert (entry["sha256"] or entry["git_sha1"]) == repo.etag(path)
    assert "[download] 4 files of 1 source(s)" in result.stdout and "[download] mix: 4 files verified" in result.stdout


def test_faults_do_not_change_the_staged_bytes_and_token_is_never_logged(clean_run, tmp_path):
    clean_root, _ = clean_run
    script = {"info": ["500", "429", "drop"], "head": ["drop", "429", "500", "drop"],
              "get": ["truncate", "drop", "429", "500", "truncate", "truncate"]}
    with FakeHub([_repo()], token=TOKEN, fault_rate=0.3, seed=1, script=script) as hub:
        result = _prepare(_config(tmp_path), hub, tmp_path / "hf_home")
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [outcome for _, _, outcome in hub.log]
    assert all(kind in outcomes for kind in FAULTS)
    faults = sum(o in FAULTS for o in outcomes)
    assert faults >= 13 and faults >= len(outcomes) // 4  # a good share of all requests failed
    assert _staged(tmp_path) == _staged(clean_root)
    assert "401" not in outcomes  # the token was sent on every request
    assert TOKEN not in result.stdout + result.stderr
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_file_that_never_succeeds_fails_the_run_and_a_rerun_fetches_only_what_is_missing(clean_run, tmp_path):
    clean_root, _ = clean_run
    broken = "extra/notes.jsonl"  # last in download order: the files before it complete first
    with FakeHub([_repo()], token=TOKEN, always_fail={broken}) as hub:
        result = _prepare(_config(tmp_path, max_attempts=3), hub, tmp_path / "hf_home")
    assert result.returncode != 0
    assert broken in result.stderr and "failed after 3 attempt(s)" in result.stderr
    assert not (tmp_path / "out" / "staging" / "mix").exists()

    download = tmp_path / "out" / "download" / "mix"
    complete = [p for p in PARQUETS if (download / p).is_file()]
    assert len(complete) >= 2, "the files before the broken one should have completed"
    partial = complete[0]
    data = (download / partial).read_bytes()
    (download / partial).write_bytes(data[: len(data) // 3])  # a partial file left behind
    # what a job killed in the middle of a file leaves: huggingface_hub's temporary file, under a name no later call
    # uses (its lock and metadata files are reused and stay)
    library = download / ".cache" / "huggingface" / "download" / "extra"
    library.mkdir(parents=True, exist_ok=True)
    (library / "notes.jsonl.lock").write_bytes(b"")
    stale = library / "3f2a.notes.jsonl.0123abcd.incomplete"
    stale.write_bytes(b"half a file")
    with FakeHub([_repo()], token=TOKEN) as hub:
        result = _prepare(_config(tmp_path), hub, tmp_path / "hf_home")
        assert result.returncode == 0, result.stderr[-3000:]
        assert _file_gets(hub, broken) >= 1 and _file_gets(hub, partial) >= 1
        for path in complete[1:]:
            assert _file_gets(hub, path) == 0, f"{path} was complete and should not be fetched again"
    assert _staged(tmp_path) == _staged(clean_root)
    assert "[download] mix: removed 1 temporary file(s) of downloads interrupted" in result.stdout
    assert not list(download.rglob("*.incomplete")) and (library / "notes.jsonl.lock").exists()


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """Every wait of huggingface_hub's retries and of fetch_file's, recorded instead of slept."""
    import time

    waited: list[float] = []
    monkeypatch.setattr(time, "sleep", waited.append)
    return waited


def _outcomes(hub: FakeHub) -> list[str]:
    return [f"{method} {outcome}" for method, _, outcome in hub.log]


@pytest.mark.parametrize("kind, fault, survived, requests, waits", [
    ("info", "429", False, ["GET 429"], []),
    ("info", "500", False, ["GET 500"], []),
    ("info", "drop", False, ["GET drop"], []),
    ("head", "429", True, ["HEAD 429", "HEAD ok", "GET ok"], []),
    ("head", "500", True, ["HEAD 500", "HEAD ok", "GET ok"], []),
    ("head", "drop", False, ["HEAD drop"], []),
    ("get", "429", True, ["HEAD ok", "GET 429", "GET ok"], [2.0]),  # Retry-After: 1, plus 1 s
    ("get", "500", False, ["HEAD ok", "GET 500"], []),
    ("get", "drop", True, ["HEAD ok", "GET drop", "GET ok"], [1]),
    ("get", "truncate", True, ["HEAD ok", "GET truncate", "GET ok"], [1]),
])
def test_what_huggingface_hub_retries(tmp_path, sleeps, kind, fault, survived, requests, waits):
    """The library's own retries, one fault at a time (hub_download's docstring; fetch_file and list_repo_files
    retry exactly the cases that fail here): `HfApi.dataset_info` retries nothing, `hf_hub_download` neither a
    dropped connection before its metadata answer nor a 5xx answer to its GET. A library upgrade that changes a
    line fails it: then hub_download's own retries should change with it."""
    from huggingface_hub import HfApi, hf_hub_download

    repo = _repo()
    with FakeHub([repo], script={kind: [fault]}) as hub:
        try:
            if kind == "info":
                HfApi(endpoint=hub.endpoint).dataset_info(repo.repo_id, revision="main", files_metadata=True)
            else:
                hf_hub_download(repo.repo_id, PARQUETS[0], repo_type="dataset", revision=repo.commit,
                                local_dir=tmp_path, endpoint=hub.endpoint)
            outcome = True
        except Exception:
            outcome = False
    assert (outcome, _outcomes(hub), sleeps) == (survived, requests, waits)
    if survived and kind != "info":
        assert (tmp_path / PARQUETS[0]).read_bytes() == repo.files[PARQUETS[0]]


def test_listing_and_fetch_retry_what_the_library_gives_up_on(tmp_path, sleeps):
    """list_repo_files sends the listing through huggingface_hub's http_backoff (a 500, a 429 honouring
    Retry-After, a dropped connection: retried); fetch_file calls hf_hub_download again after a dropped connection
    before the metadata answer and after a 500 answer to the GET (waits of 1, then 2 s), and fails naming repo,
    commit and file after `max_attempts` calls; a 404 is not retried."""
    from huginn_ray.data import hub_download
    from huginn_ray.data.config import DownloadConfig

    repo = _repo()
    path = PARQUETS[1]
    cfg = DownloadConfig(max_attempts=3)
    with FakeHub([repo], script={"info": ["500", "429", "drop"], "head": ["drop"], "get": ["500"]}) as hub:
        commit, files = hub_download.list_repo_files(repo.repo_id, "main", ["data/*"], hub.endpoint, None,
                                                     DownloadConfig(max_attempts=4))
        assert commit == repo.commit and [f.path for f in files] == PARQUETS
        assert (_outcomes(hub), sleeps) == (["GET 500", "GET 429", "GET drop", "GET ok"], [1, 2.0, 4])
        hub.log.clear(), sleeps.clear()
        (hub_file,) = [f for f in files if f.path == path]
        assert hub_download.fetch_file(repo.repo_id, commit, hub_file, str(tmp_path), hub.endpoint, None, cfg) == {
            "path": path, "size": len(repo.files[path]), "skipped": False, "trusted": False}
        assert _outcomes(hub) == ["HEAD drop", "HEAD ok", "GET 500", "HEAD ok", "GET ok"] and sleeps == [1.0, 2.0]
        assert (tmp_path / path).read_bytes() == repo.files[path]

        hub.log.clear(), sleeps.clear()
        wrong = hub_download.HubFile(PARQUETS[2], hub_file.size, "0" * 64, None)  # bytes that never match the hash
        with pytest.raises(hub_download.DownloadError, match=rf"^acme/mix@{commit[:12]}: {PARQUETS[2]}: failed after "
                                                              r"3 attempt\(s\): OSError: .* size or hash differs"):
            hub_download.fetch_file(repo.repo_id, commit, wrong, str(tmp_path), hub.endpoint, None, cfg)
        assert sleeps == [1.0, 2.0] and not (tmp_path / PARQUETS[2]).exists()

        hub.log.clear(), sleeps.clear()
        missing = hub_download.HubFile("data/missing.parquet", 10, "0" * 64, None)
        with pytest.raises(hub_download.DownloadError, match=r"data/missing.parquet: failed after 1 attempt\(s\)"):
            hub_download.fetch_file(repo.repo_id, commit, missing, str(tmp_path), hub.endpoint, None, cfg)
        assert _outcomes(hub) == ["HEAD 404"] and sleeps == []


@pytest.mark.parametrize("name", ["../../escape.parquet", "data/../../escape.parquet", "/etc/escape.parquet"])
def test_file_name_outside_the_folder_is_refused_before_anything_is_touched(tmp_path, monkeypatch, name):
    from huginn_ray.config import parse_yaml
    from huginn_ray.data.config import DownloadConfig
    from huginn_ray.data.hub_download import DownloadError, download_sources
    from huginn_ray.data.sources import parse_sources

    repo = HubRepo("acme/evil", {"data/ok.parquet": _parquet(0), name: _parquet(1)})
    source = parse_sources(parse_yaml("- {name: evil, address: acme/evil, features: [content], files: ['*']}"),
                           "sources.yaml")[0]
    with FakeHub([repo]) as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        with pytest.raises(DownloadError, match="which would resolve outside"):
            download_sources([source], tmp_path / "download", DownloadConfig(max_attempts=1))
        assert not any(method == "GET" and "/resolve/" in p for method, p, _ in hub.log)
    assert not (tmp_path / "download").exists()


def test_sources_download_concurrently_under_one_limit(tmp_path):
    second = HubRepo("acme/other", {f"data/part-{i}.parquet": _parquet(10 + i) for i in range(3)})
    config = _config(tmp_path, max_attempts=3)
    (tmp_path / "sources.yaml").write_text((tmp_path / "sources.yaml").read_text() + """
- name: other
  address: acme/other
  files: ["data/*.parquet"]
  features: [content]
""")
    with FakeHub([_repo(), second], token=TOKEN) as hub:
        result = _prepare(config, hub, tmp_path / "hf_home")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[download] 7 files of 2 source(s)" in result.stdout
    for name in ("mix", "other"):
        assert json.loads((tmp_path / "out" / "download" / name / "_provenance.json").read_text())["source"] == name


def test_hub_source_whose_patterns_match_no_file_is_an_error(tmp_path, monkeypatch):
    from huginn_ray.config import parse_yaml
    from huginn_ray.data.config import DownloadConfig
    from huginn_ray.data.hub_download import DownloadError, download_sources
    from huginn_ray.data.sources import parse_sources

    source = parse_sources(parse_yaml(
        "- {name: algebra, address: acme/mix, features: [text], files: ['algebraic-stack/*.jsonl.zst']}"),
        "sources.yaml")[0]
    with FakeHub([_repo()]) as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        with pytest.raises(DownloadError, match=r"source 'algebra': no file of acme/mix@\w+ matches "
                                                r"\['algebraic-stack/\*.jsonl.zst'\]"):
            download_sources([source], tmp_path / "download", DownloadConfig(max_attempts=1))


def test_plan_of_the_113_huginn_sources_offline_against_the_local_hub(tmp_path, monkeypatch, capsys):
    """--plan lists every Hub source (metadata only: nothing downloaded or written) and sums the served sizes."""
    import fnmatch
    import importlib.util

    from huginn_ray.data.sources import load_sources

    sources = load_sources(ROOT / "configs" / "data" / "huginn_sources.yaml")
    repos: dict[str, dict[str, bytes]] = {}
    expected_files = expected_bytes = 0
    for i, s in enumerate(sources):
        if s.requires_software_heritage_aws_download or s.weight == 0:
            continue
        path = s.file_patterns[0].replace("*", f"part-{i}")
        assert any(fnmatch.fnmatch(path, p) for p in s.file_patterns), path
        repos.setdefault(s.address, {})[path] = b"x" * (1000 + i)
        expected_files += 1
        expected_bytes += 1000 + i
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "jobs" / "prepare_data.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    with FakeHub([HubRepo(address, files) for address, files in repos.items()] + [gsm8k_repo()]) as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        capsys.readouterr()
        assert job.main(["--config", str(ROOT / "configs" / "data" / "huginn.yaml"), "--plan", "--json",
                         f"output_dir={tmp_path / 'out'}", f"tokenizer.path={tmp_path / 'no_tokenizer'}"]) == 0
        assert not any("/resolve/" in p for _, p, _ in hub.log)  # listings only
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["sources"]) == 113 and plan["counts"]["input_files"] == expected_files
    assert plan["input_bytes"] == expected_bytes
    assert plan["estimated_tokens"] > 0 and plan["peak_disk_bytes"] > expected_bytes
    assert plan["counts"]["shard_files"] == 2 * 4096 and not (tmp_path / "out").exists()
    # the one source a run refuses (its files are in Software Heritage's bucket) is named, not silently left out
    assert plan["unsupported_sources"] == [s.name for s in sources if s.requires_software_heritage_aws_download]
    # decontamination against GSM8k's whole test split on the Hub: listed, fetched only when the run starts
    assert plan["filter"]["ngram_set"]["why"] == "a Hub evaluation set is not fetched yet: built when the run starts"


def test_a_verified_file_is_trusted_by_its_record_until_its_size_or_mtime_changes(tmp_path, monkeypatch):
    """fetch_file records a verified file's size, mtime and hash; called again it neither fetches nor hashes the
    file while both match the record, hashes it again (no fetch) when only its mtime changed, and fetches it again
    when the hash then differs."""
    from huginn_ray.data import hub_download
    from huginn_ray.data.config import DownloadConfig

    repo = _repo()
    path = PARQUETS[1]
    hub_file = hub_download.HubFile(path, len(repo.files[path]), hashlib.sha256(repo.files[path]).hexdigest(), None)
    hashed = []
    real_verify = hub_download.verify
    monkeypatch.setattr(hub_download, "verify", lambda p, e: hashed.append(p.name) or real_verify(p, e))
    folder = tmp_path / "mix"
    with FakeHub([repo]) as hub:
        def fetch() -> dict:
            return hub_download.fetch_file(repo.repo_id, repo.commit, hub_file, str(folder), hub.endpoint, None,
                                           DownloadConfig(max_attempts=2))

        assert fetch() == {"path": path, "size": hub_file.size, "skipped": False, "trusted": False}
        target = folder / path
        stat = target.stat()
        assert json.loads((folder / ".huginn_verified" / f"{path}.json").read_text()) == {
            "size": hub_file.size, "mtime_ns": stat.st_mtime_ns, "hash": hub_file.sha256}
        hashed.clear()
        assert fetch()["trusted"] and hashed == [] and _file_gets(hub, path) == 1  # neither hashed nor fetched

        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: hashed again, not fetched
        assert fetch() == {"path": path, "size": hub_file.size, "skipped": True, "trusted": False}
        assert hashed == ["train-00001.parquet"] and _file_gets(hub, path) == 1
        hashed.clear()
        assert fetch()["trusted"] and hashed == []  # its new mtime was recorded with the hash

        data = bytearray(target.read_bytes())  # same size, other bytes, a new mtime: hashed, refused, fetched
        data[100] ^= 0xFF
        target.write_bytes(bytes(data))
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
        assert fetch()["skipped"] is False and _file_gets(hub, path) == 2
        assert target.read_bytes() == repo.files[path]


def test_a_hub_evaluation_set_decontaminates_a_local_source_end_to_end(tmp_path):
    """decontaminate.against names a Hub dataset: prepare_data (its own local Ray; HF_ENDPOINT and HF_TOKEN in its
    environment, as a user sets them) resolves it to a commit, fetches its test split into <output_dir>/eval_sets/,
    and the filter stage drops the one training document holding a question of it, counted, the match naming repo,
    commit, file and row; the n-gram set records the commit and file hash; the token is never printed."""
    repo = gsm8k_repo()
    web = [f"document {i}: " + "some words about nothing in particular " * 3 for i in range(6)]
    web[4] = f"Homework. {HUB_QUESTIONS[1].upper()} Show your work."
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in web))
    (tmp_path / "sources.yaml").write_text("- {name: web, local_dir: web, features: [text]}\n")
    config = tmp_path / "data.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nsources: sources.yaml\n"
                      "local_ray: {num_cpus: 2, object_store_mib: 128}\n"
                      "decontaminate: {mode: drop, against: [{hub: openai/gsm8k, config: main, split: test}]}\n")
    with FakeHub([repo], token=TOKEN) as hub:
        result = _prepare(config, hub, tmp_path / "hf_home", stages=("staging", "filter"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert TOKEN not in result.stdout + result.stderr
    assert (f"[decontaminate] openai/gsm8k (main, test) at {repo.commit[:12]}: 1 file(s) in {tmp_path / 'out'}/"
            "eval_sets") in result.stdout
    assert ("[filter] web: 6 documents -> 5 kept; decontaminated: 1 dropped; exact duplicates dropped: 0 (dedup off)"
            in result.stdout)
    out = tmp_path / "out"
    kept = pq.read_table(out / "filtered" / "web" / "00000.parquet").column("text").to_pylist()
    assert kept == web[:4] + web[5:]
    (match,) = [json.loads(line) for line in (out / "filtered" / "decontamination.jsonl").read_text().splitlines()]
    assert (match["doc_id"], match["item"], match["dropped"]) == (
        4, f"openai/gsm8k@{repo.commit[:12]}/main/test-00000-of-00001.parquet, row 2, question", True)
    data = repo.files["main/test-00000-of-00001.parquet"]
    assert json.loads((out / "filtered" / "ngrams.json").read_text())["origins"] == [{
        "hub": "openai/gsm8k", "config": "main", "split": "test", "revision": "main", "commit": repo.commit,
        "files": [{"path": "main/test-00000-of-00001.parquet", "size": len(data),
                   "hash": hashlib.sha256(data).hexdigest()}]}]
    assert (out / "eval_sets" / f"openai/gsm8k@{repo.commit}" / "main/test-00000-of-00001.parquet").read_bytes() == data


def test_the_tokenizer_stages_leave_the_evaluation_sets_alone(tmp_path, monkeypatch):
    """jobs/train_tokenizer.py runs the download and staging stages: a Hub evaluation set of decontaminate.against
    (which only the filter stage reads, and the pack stage checks) is neither resolved nor fetched for them; a run
    of the filter stage resolves and fetches it before the plan. The plan is stubbed to stop each run there."""
    from huginn_ray.data import pipeline
    from huginn_ray.data.config import load_data_config

    class Planned(Exception):
        pass

    given = []

    def plan(cfg, sources, ngrams):
        given.append(ngrams)
        raise Planned

    config = web_config_against_hub(tmp_path, "openai/gsm8k")
    monkeypatch.setattr(pipeline, "build_plan", plan)
    repo = gsm8k_repo()
    with FakeHub([repo]) as hub:
        use_endpoint(monkeypatch, hub)
        with pytest.raises(Planned):
            pipeline.run(load_data_config(config), ("download", "staging"))
        assert given == [None] and hub.log == []
        with pytest.raises(Planned):
            pipeline.run(load_data_config(config), ("download", "staging", "filter"))
        assert given[1].origins[0]["commit"] == repo.commit
        assert [f"{method} {path}" for method, path, _ in hub.log] == [
            "GET /api/datasets/openai/gsm8k/revision/main",
            f"HEAD /datasets/openai/gsm8k/resolve/{repo.commit}/main/test-00000-of-00001.parquet",
            f"GET /datasets/openai/gsm8k/resolve/{repo.commit}/main/test-00000-of-00001.parquet"]


@pytest.fixture(scope="module")
def local_ray():
    with module_ray("hrdh_", object_store_mib=128):
        yield


def _killed_once(fn, flag: Path):
    """The stage's map, except that its first call SIGKILLs its own worker after its file is fetched, verified and
    recorded, before the result goes back, and the first later call that fetches a file SIGKILLs its worker in
    the middle of the file: its bytes received into huggingface_hub's temporary `.incomplete` file, not yet moved
    into place. Every call appends (path, memory= Ray gave it, killed, killed mid-file or ran) to
    `<flag>.memory`."""

    def first_call_dies(table, **kwargs):
        import ray
        from huggingface_hub import file_download

        path = table.column("path")[0].as_py()
        memory = ray.get_runtime_context().get_assigned_resources().get("memory")
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:  # a later call, or the rerun of the killed one
            with open(flag.with_suffix(".memory"), "a") as f:
                f.write(json.dumps([path, memory, "ran"]) + "\n")
            http_get = file_download.http_get

            def dies_after_the_body(*args, **kw):
                http_get(*args, **kw)
                try:
                    os.close(os.open(flag.with_suffix(".mid"), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    return
                with open(flag.with_suffix(".memory"), "a") as f:
                    f.write(json.dumps([path, memory, "killed mid-file"]) + "\n")
                os.kill(os.getpid(), signal.SIGKILL)

            file_download.http_get = dies_after_the_body
            try:
                return fn(table, **kwargs)
            finally:
                file_download.http_get = http_get
        fn(table, **kwargs)
        with open(flag.with_suffix(".memory"), "a") as f:
            f.write(json.dumps([path, memory, "killed"]) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    return first_call_dies


def test_a_killed_download_worker_is_rerun_with_more_memory_trusting_what_it_verified(local_ray, tmp_path,
                                                                                       monkeypatch, capsys):
    """A download task's worker dies (SIGKILL) after its file is verified: the files not yet returned run again,
    each with twice the memory (execution.rerun_killed; tasks declare none at first, counted as
    UNDECLARED_MEMORY), and the killed task's file is trusted by its verification record, not fetched again. Then
    a worker dies in the middle of a file (one download at a time, so: the next file): that file is fetched again
    with twice that memory, and the `.incomplete` file the library left is removed once the source is complete."""
    from huginn_ray.config import parse_yaml
    from huginn_ray.data import hub_download
    from huginn_ray.data.config import DownloadConfig
    from huginn_ray.data.execution import UNDECLARED_MEMORY
    from huginn_ray.data.sources import parse_sources

    repo = _repo()
    source = parse_sources(parse_yaml("- {name: mix, address: acme/mix, features: [content], "
                                      "files: ['data/*.parquet', 'extra/*.jsonl']}"), "sources.yaml")[0]
    monkeypatch.setattr(hub_download, "download_files", _killed_once(hub_download.download_files, tmp_path / "kill"))
    with FakeHub([repo]) as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        provenance = hub_download.download_sources([source], tmp_path / "download",
                                                   DownloadConfig(max_in_flight=1, max_attempts=1))
    out = capsys.readouterr().out
    assert re.search(r"\[download\] a worker was killed \(\w+\); rerunning the [1-4] units that had not finished, "
                     "each with twice its memory", out)
    attempts = [json.loads(line) for line in (tmp_path / "kill.memory").read_text().splitlines()]
    [(killed, memory)] = [(path, memory) for path, memory, what in attempts if what == "killed"]
    # its rerun twice the memory; again twice that when the dataset stopped at the second kill before its result
    # reached the driver
    assert memory is None and [m for p, m, what in attempts if p == killed and what == "ran"] in (
        [2 * UNDECLARED_MEMORY], [2 * UNDECLARED_MEMORY, 4 * UNDECLARED_MEMORY])
    assert _file_gets(hub, killed) == 1  # fetched by the killed task, trusted by its rerun
    [(mid_file, mid_memory)] = [(path, memory) for path, memory, what in attempts if what == "killed mid-file"]
    assert mid_memory == 2 * UNDECLARED_MEMORY and mid_file != killed
    assert [m for p, m, what in attempts if p == mid_file and what == "ran"] == [mid_memory, 2 * mid_memory]
    assert _file_gets(hub, mid_file) == 2  # its bytes lost with the killed worker: fetched again
    assert "[download] mix: removed 1 temporary file(s) of downloads interrupted by a killed worker" in out
    assert not list((tmp_path / "download").rglob("*.incomplete"))
    trusted = re.search(r"\[download\] 4 files of 1 source\(s\), .* already complete, (\d) of them by their "
                        r"verification record\)", out)
    assert trusted and int(trusted.group(1)) >= 1
    assert [f["path"] for f in provenance["mix"]["files"]] == sorted(PARQUETS + ["extra/notes.jsonl"])
    for path in PARQUETS + ["extra/notes.jsonl"]:
        assert (tmp_path / "download" / "mix" / path).read_bytes() == repo.files[path]
