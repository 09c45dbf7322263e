"""Data pipeline throughput per stage: records per second of staging, filter, pack and shuffle; tokenize+pack
tokens/s per CPU core vs raw `tokenizers` encode_batch.

    python bench/data_pipeline.py [--text code|web|math] [--mib 64] [--cpus 2] [--vocab 16384] [--seq-len 4096]
                                  [--filter [--near]] [--json] [--tokenizer DIR] [--out /tmp/hr_bench]
                                  [--against TREE [--rounds 3]]

Builds a local source of --text documents (each repeated with a distinct header until --mib MiB; no network):
  code - the Python standard library's .py files;
  web  - English prose and markdown from this machine's package documentation (/usr/share/doc, gzip files
         decompressed, and the installed Python packages' METADATA / README files);
  math - generated worked problems (seeded): arithmetic, algebra and calculus statements in LaTeX with their
         solution steps and numbers;
stages it, trains a tokenizer (huginn_ray.data.tokenizer.train_tokenizer) on 8 MiB of each of the three kinds,
kept in --tokenizer DIR when given (reused when DIR already holds one), then runs the stages one after the other
on a local Ray with --cpus CPUs, each timed on its own through the pipeline's stage entry points:
  ray data start-up - timed on its own before the stages: the first Ray Data dataset of a Ray cluster starts Ray
            Data's stats and autoscaling-coordinator actors (detached: once per cluster, so once per prepare_data
            run on a local Ray) and worker processes that import Ray Data; a trivial dataset of one task per CPU
            pays it here (one worker process per CPU, each importing the data stages), so that the stage figures
            below are each stage's own (this start-up is the same for every implementation on
            Ray Data and is reported beside them, never in them);
  staging - jsonl -> staged parquet: documents/s, and MiB of text per s per CPU;
  filter  - with --filter only: `decontaminate` (mode drop, 13-grams) against configs/eval/gsm8k_test_sample.jsonl
            (4 GSM8k test problems) and `dedup: exact`, documents/s; the corpus then holds one more file of two
            documents, an exact copy of the corpus's first document and one quoting a GSM8k problem: the filter
            must drop exactly one of each (the bench stops, naming the counts, when it does not); with --near,
            `dedup: near` (exact, then MinHash LSH with the default near_dedup settings) instead of exact: the
            corpus's repeats of a document under distinct headers are near duplicates of its first copy, so most
            of a repeated corpus is dropped (the count is printed);
  raw     - one process, one thread: Tokenizer.encode_batch_fast over the staged documents in batches, before and
            after the pack stage (their mean is the reference), with the tokenizer as the pack stage loads it
            (special-token strings encoded as text: load_text_tokenizer); once more with the special tokens
            matched (Tokenizer.from_file as is), for the cost of encoding them as text;
  pack    - the pack stage (read + encode + hold-out + pack + write): records (documents) per second, and tokens/s
            per CPU;
  shuffle - the shuffle stage over the packed rows (map/reduce into 2*num_shards files): rows/s and MiB/s.
Figures are printed (with --json, one more line: a JSON object of the per-stage figures); beyond the filter's
probe counts nothing is asserted.

With --against TREE (a checkout or `git archive` export of another commit, e.g. the previous implementation), the
bench runs itself --rounds times for each tree, alternating (this tree first), each run a separate process with
PYTHONPATH set to its tree (every run prints the huginn_ray its driver and a Ray worker import), the other options
passed on (give --tokenizer as an absolute path: each run starts in its tree's root, which Ray's workers import
from; a run whose driver or workers import another huginn_ray stops the bench), and prints each stage's records/s
per run and the ratio of the medians (this tree / TREE); with --json one more line holding every run's figures.
The harness (corpus, probes, timing) is this file for both trees.
The eval set's n-grams are built on the driver before the filter stage, outside its time, as `pipeline.run` does.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from huginn_ray.data.config import load_data_config
from huginn_ray.data.pipeline import (eval_ngrams, init_ray, run_stage_filter, run_stage_pack, run_stage_shuffle,
                                      run_stage_staging)
from huginn_ray.data.sources import load_sources
from huginn_ray.data.tokenizer import train_tokenizer


def code_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [t for path in sorted(stdlib.rglob("*.py")) if (t := _read(path))]


def web_texts() -> list[str]:
    paths = [p for p in sorted(Path("/usr/share/doc").rglob("*")) if p.is_file() and not p.is_symlink()]
    for site in sorted(Path(p) for p in sys.path if p.endswith("site-packages")):
        paths += sorted(p for p in site.rglob("*") if p.name == "METADATA" or p.suffix.lower() in (".md", ".rst"))
    return [t for path in paths if (t := _read(path))]


def math_texts(n: int = 40000) -> list[str]:
    rng = random.Random(0)
    texts = []
    for i in range(n):
        a, b, c, d = (rng.randint(2, 99) for _ in range(4))
        x = rng.randint(-20, 20)
        parts = [
            f"Problem {i}. Let $f(x) = {a}x^2 - {b}x + {c}$. Compute $f({x})$ and $f'({x})$.\n",
            f"Solution. $f({x}) = {a}\\cdot {x * x} - {b}\\cdot ({x}) + {c} = {a * x * x - b * x + c}$. "
            f"Since $f'(x) = {2 * a}x - {b}$, we get $f'({x}) = {2 * a * x - b}$.\n",
            f"A train travels {a * 10} km in {b % 9 + 1} hours and then {c * 5} km in {d % 7 + 1} hours. Its average "
            f"speed is $\\frac{{{a * 10} + {c * 5}}}{{{b % 9 + 1} + {d % 7 + 1}}} = "
            f"{(a * 10 + c * 5) / (b % 9 + d % 7 + 2):.4f}$ km/h.\n",
            f"Theorem. For all integers $n \\geq {c % 5}$, $\\sum_{{k=1}}^{{n}} k^{{{d % 4 + 1}}}$ is a polynomial in $n$ "
            f"of degree {d % 4 + 2}. Proof. By induction on $n$; the case $n = {c % 5}$ is immediate.\n",
            f"$$\\int_0^{{{d}}} ({a}t + {b})\\,dt = {a * d * d / 2 + b * d:g}, \\quad "
            f"\\gcd({a * b}, {c * d}) = {__import__('math').gcd(a * b, c * d)}.$$\n",
        ]
        texts.append("".join(parts[: rng.randint(2, 5)]))
    return texts


TEXTS = {"code": code_texts, "web": web_texts, "math": math_texts}


def _read(path: Path) -> str:
    """The file's text (gzip decompressed), at most 32 KiB of it; '' when it is not UTF-8 text."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return data.decode("utf-8")[:32768]
    except (UnicodeDecodeError, OSError, EOFError, gzip.BadGzipFile):
        return ""


def build_corpus(root: Path, texts: list[str], mib: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    target, written, part, rep = mib << 20, 0, 0, 0
    out = open(root / f"part{part:03d}.jsonl", "w")
    while written < target:
        for i, text in enumerate(texts):
            line = json.dumps({"text": f"# copy {rep} of document {i}\n{text}"}) + "\n"
            out.write(line)
            written += len(line)
            if out.tell() > 64 << 20:
                out.close()
                part += 1
                out = open(root / f"part{part:03d}.jsonl", "w")
            if written >= target:
                break
        rep += 1
    out.close()


def _first_mib(texts: list[str], mib: int) -> list[str]:
    out, size = [], 0
    for text in texts:
        out.append(text)
        size += len(text)
        if size > mib << 20:
            break
    return out


GSM8K_SAMPLE = Path(__file__).resolve().parents[1] / "configs" / "eval" / "gsm8k_test_sample.jsonl"


def write_filter_probe(corpus: Path, first_text: str) -> None:
    """One more input file of two documents the filter must drop: an exact copy of the corpus's first document
    (build_corpus writes it first) and one quoting the first GSM8k sample problem (13-grams in common)."""
    problem = json.loads(GSM8K_SAMPLE.read_text().splitlines()[0])
    with open(corpus / "part999_filter_probe.jsonl", "w") as out:
        out.write(json.dumps({"text": f"# copy 0 of document 0\n{first_text}"}) + "\n")
        out.write(json.dumps({"text": f"Homework help. {problem['question']} Show your work."}) + "\n")


def code_under_test() -> str:
    """Where the driver and a Ray worker import huginn_ray from: an export run with PYTHONPATH must show its own
    path in both (the venv's editable install, or the working directory, would win otherwise)."""
    import ray

    import huginn_ray

    worker = ray.get(ray.remote(lambda: __import__("huginn_ray").__file__).remote())
    return f"driver {Path(huginn_ray.__file__).parent}, Ray worker {Path(worker).parent}"


WORKER_WARM_UP_S = 0.5
"""How long each start-up task holds its CPU, so that the tasks run at once, one per CPU, each on a worker process
of its own."""


def ray_data_start_up(cpus: int) -> float:
    """Seconds of the first Ray Data dataset of this cluster: a trivial one of one task per CPU, run at once, which
    starts Ray Data's actors and one worker process per CPU that imports Ray Data and the data stages (including
    WORKER_WARM_UP_S). Without it the first stage pays for the worker processes its tasks need: measured, staging's
    one task per input file waited 2.4 s for a second worker to start for the corpus's small files."""
    import ray.data

    def started_worker(batch):  # nested: Ray's workers get it by value (they cannot import this script)
        import huginn_ray.data.pipeline  # noqa: F401 - what every stage's task imports

        time.sleep(WORKER_WARM_UP_S)
        return batch

    start = time.perf_counter()
    ray.data.range(cpus, override_num_blocks=cpus).map_batches(started_worker).materialize()
    return time.perf_counter() - start


STAGE_RATES = {"staging": "documents_per_s", "filter": "documents_per_s", "pack": "records_per_s",
               "shuffle": "rows_per_s"}


def compare(argv: list[str], against: Path, rounds: int, as_json: bool) -> None:
    """Run this bench `rounds` times for this tree and for `against`, alternating, and print the stages' records/s
    side by side (argv: the options to pass on, without --against / --rounds)."""
    here = Path(__file__).resolve().parents[1]
    trees = {"this": here, "against": against.resolve()}
    runs: dict[str, list[dict]] = {"this": [], "against": []}
    for round_ in range(rounds):
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree)}
            # run from the tree's root: Ray's workers put the driver's working directory first on their path
            done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--json"], env=env,
                                  cwd=tree, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"run {round_ + 1} of {tree} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            figures = runs[name][-1]
            if figures["huginn_ray"] != f"driver {tree / 'huginn_ray'}, Ray worker {tree / 'huginn_ray'}":
                sys.exit(f"run {round_ + 1} of {tree} imported another huginn_ray: {figures['huginn_ray']}")
            print(f"round {round_ + 1}, {name} ({tree}): ray data start-up {figures['ray_data_start_s']:.1f}s, "
                  + ", ".join(f"{stage} {figures[stage][rate]:,.0f}/s" for stage, rate in STAGE_RATES.items()
                              if figures.get(stage)), flush=True)
    print(f"\n=== {here} against {against} ({rounds} rounds, alternating; median records/s) ===")
    medians = {}
    for stage, rate in STAGE_RATES.items():
        if not runs["this"][0].get(stage):
            continue
        this, other = ([r[stage][rate] for r in runs[name]] for name in ("this", "against"))
        medians[stage] = statistics.median(this) / statistics.median(other)
        print(f"{stage}: {', '.join(f'{x:,.0f}' for x in this)} against {', '.join(f'{x:,.0f}' for x in other)}: "
              f"{medians[stage]:.2f}x")
    start_up = {name: [r["ray_data_start_s"] for r in runs[name]] for name in runs}
    print("ray data start-up (s): " + "; ".join(f"{name} {', '.join(f'{x:.1f}' for x in xs)}"
                                              for name, xs in start_up.items()))
    if as_json:
        print(json.dumps({"this": str(here), "against": str(against), "ratios": medians, "runs": runs}))


def timed(stage, *args):
    start = time.perf_counter()
    result = stage(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", choices=sorted(TEXTS), default="code")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--cpus", type=int, default=os.cpu_count())
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--docs-per-batch", type=int, default=1024)
    parser.add_argument("--object-store-mib", type=int, default=None)
    parser.add_argument("--filter", action="store_true",
                        help="run the filter stage (decontaminate against a local GSM8k sample, dedup: exact)")
    parser.add_argument("--near", action="store_true", help="with --filter: dedup near instead of exact")
    parser.add_argument("--json", action="store_true", help="print the per-stage figures as one JSON object last")
    parser.add_argument("--tokenizer", default=None, help="keep the trained tokenizer here; reuse one found here")
    parser.add_argument("--out", default=None)
    parser.add_argument("--against", type=Path, default=None,
                        help="another tree (e.g. an export of the previous implementation): run both, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: runs of each tree")
    args = parser.parse_args()
    if args.against is not None:
        if args.out:
            sys.exit("--against runs each tree in its own temporary directory: leave out --out")
        passed = [a for i, a in enumerate(sys.argv[1:]) if a not in ("--against", "--rounds", "--json")
                  and sys.argv[i] not in ("--against", "--rounds")]
        return compare(passed, args.against, args.rounds, args.json)

    load_at_start = os.getloadavg()[0]
    root = Path(args.out or tempfile.mkdtemp(prefix="hr_bench_"))
    texts_of_kind = TEXTS[args.text]()
    build_corpus(root / "corpus", texts_of_kind, args.mib)
    if args.filter:
        write_filter_probe(root / "corpus", texts_of_kind[0])
    del texts_of_kind
    (root / "sources.yaml").write_text(f"- {{name: stdlib, local_dir: {root / 'corpus'}, features: [text]}}\n")
    local_ray = {"num_cpus": args.cpus, "object_store_mib": args.object_store_mib,
                 "temp_dir": tempfile.mkdtemp(prefix="hrb_", dir="/tmp")}
    filters = ({"decontaminate": {"mode": "drop", "ngram": 13, "against": [str(GSM8K_SAMPLE)]},
                "dedup": "near" if args.near else "exact"} if args.filter else {})
    (root / "data.yaml").write_text(json.dumps({
        "output_dir": str(root / "out"), "sources": str(root / "sources.yaml"), "seq_len": args.seq_len,
        "num_shards": args.num_shards, "docs_per_pack_batch": args.docs_per_batch, "local_ray": local_ray,
        **filters}))
    cfg = load_data_config(root / "data.yaml")
    sources = load_sources(cfg.sources)
    ngrams = eval_ngrams(cfg)  # None without --filter
    init_ray(cfg)
    code = code_under_test()
    print(f"huginn_ray: {code}", flush=True)
    start_up_s = ray_data_start_up(args.cpus)
    print(f"ray data start-up (once per cluster, before the stages): {start_up_s:.1f}s", flush=True)
    # the stages themselves, timed on their own (pipeline.run would add the plan, which samples the sources)
    _, staging_s = timed(run_stage_staging, cfg, sources)
    staged = sorted((root / "out" / "staging" / "stdlib").glob("*.parquet"))
    texts = [t for f in staged for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    staged_docs = len(texts)
    corpus_bytes = sum(len(t.encode()) for t in texts)
    if args.filter:
        filtered, filter_s = timed(run_stage_filter, cfg, sources, ngrams)
        filter_counts = filtered["sources"]["stdlib"]
        dropped = (filter_counts["decontaminated"], filter_counts["exact_duplicates_dropped"])
        if dropped != ({"dropped": 1}, 1):  # a filter that missed the probe would be timed doing less than its job
            sys.exit(f"filter stage: decontaminated {dropped[0]}, exact duplicates dropped {dropped[1]}; the probe "
                     "file (write_filter_probe) holds exactly one of each")
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else cfg.tokenizer_dir
    if not (tokenizer_dir / "tokenizer.json").exists():
        start = time.perf_counter()
        train_tokenizer([t for kind in sorted(TEXTS) for t in _first_mib(TEXTS[kind](), 8)], args.vocab, tokenizer_dir)
        print(f"tokenizer: vocab {args.vocab} trained in {time.perf_counter() - start:.0f}s", flush=True)
    if tokenizer_dir != cfg.tokenizer_dir:
        shutil.copytree(tokenizer_dir, cfg.tokenizer_dir)

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    from huginn_ray.data.tokenizer import load_text_tokenizer

    tok = load_text_tokenizer(cfg.tokenizer_dir / "tokenizer.json")  # as the pack stage encodes: specials as text
    live = Tokenizer.from_file(str(cfg.tokenizer_dir / "tokenizer.json"))  # special-token strings matched

    def raw_rate(tokenizer) -> float:
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(texts), cfg.docs_per_pack_batch):
            tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts[i:i + cfg.docs_per_pack_batch]))
        return tokens / (time.perf_counter() - start)

    # raw before and after the pack stage: load from other processes that changes meanwhile shows as a spread
    raw_before = raw_rate(tok)
    raw_live = raw_rate(live)
    marker, pack_s = timed(run_stage_pack, cfg, sources, ngrams)
    raw_after = raw_rate(tok)
    del texts
    packed_bytes = sum(p.stat().st_size for p in (root / "out" / "packed").glob("*.parquet"))
    packed_rows = sum(f["train_rows"] + f["val_rows"] for f in marker["files"])
    _, shuffle_s = timed(run_stage_shuffle, cfg, sources)

    pack_tokens = sum(s["doc_tokens"] for s in marker["sources"].values())
    pack_docs = sum(s["docs"] for s in marker["sources"].values())
    raw = (raw_before + raw_after) / 2
    pack_rate = pack_tokens / pack_s / args.cpus
    corpus_mib = corpus_bytes / 2**20
    load_at_end = os.getloadavg()[0]
    print("\n=== data pipeline benchmark ===")
    print(f"corpus: {args.text} text, {corpus_mib:.0f} MiB text, {staged_docs:,d} documents, "
          f"{pack_tokens / 1e6:.1f}M tokens, vocab {args.vocab}, seq_len {args.seq_len}, {args.cpus} Ray CPUs, "
          f"load average {load_at_start:.1f} at the start, {load_at_end:.1f} at the end")
    print(f"ray data start-up: {start_up_s:.1f}s (before the stages, not in their figures)")
    print(f"staging stage: {staged_docs:,d} documents, {corpus_mib:.0f} MiB of text in {staging_s:.1f}s = "
          f"{staged_docs / staging_s:,.0f} documents/s, {corpus_mib / staging_s / args.cpus:.1f} MiB/s per CPU")
    if args.filter:
        print(f"filter stage: {staged_docs:,d} documents in {filter_s:.1f}s = {staged_docs / filter_s:,.0f} "
              f"documents/s ({staged_docs / filter_s / args.cpus:,.0f} per CPU); kept {filter_counts['rows']:,d}, "
              f"decontaminated {filter_counts['decontaminated']}, exact duplicates dropped "
              f"{filter_counts['exact_duplicates_dropped']}"
              f"{'' if not args.near else ', near duplicates dropped %d' % filter_counts['near_duplicates_dropped']}")
    print(f"raw encode_batch_fast (1 process, 1 thread): {raw / 1e3:.0f}k tokens/s "
          f"(before the pack stage {raw_before / 1e3:.0f}k, after {raw_after / 1e3:.0f}k); with special-token "
          f"strings matched as control tokens (Tokenizer.from_file as is), before the pack stage: "
          f"{raw_live / 1e3:.0f}k tokens/s")
    print(f"pack stage: {pack_tokens / 1e6:.1f}M tokens in {pack_s:.1f}s = {pack_rate / 1e3:.0f}k tokens/s per CPU "
          f"({pack_rate / raw:.0%} of raw); {pack_docs:,d} records (documents) = {pack_docs / pack_s:,.0f} records/s, "
          f"{pack_docs / pack_s / args.cpus:,.0f} per CPU")
    print(f"shuffle stage: {packed_rows:,d} rows, {packed_bytes / 2**20:.0f} MiB packed in {shuffle_s:.1f}s = "
          f"{packed_rows / shuffle_s:,.0f} rows/s, {packed_bytes / 2**20 / shuffle_s:.1f} MiB/s")
    if args.json:
        figures = {
            "huginn_ray": code, "text": args.text, "cpus": args.cpus, "load_average": [load_at_start, load_at_end],
            "ray_data_start_s": start_up_s,
            "staging": {"documents": staged_docs, "mib": corpus_mib, "seconds": staging_s,
                        "documents_per_s": staged_docs / staging_s,
                        "mib_per_s_per_cpu": corpus_mib / staging_s / args.cpus},
            "filter": {"documents": staged_docs, "kept": filter_counts["rows"],
                       "decontaminated": filter_counts["decontaminated"],
                       "exact_duplicates_dropped": filter_counts["exact_duplicates_dropped"],
                       "near_duplicates_dropped": filter_counts.get("near_duplicates_dropped"), "seconds": filter_s,
                       "documents_per_s": staged_docs / filter_s} if args.filter else None,
            "raw_tokens_per_s": raw,
            "pack": {"records": pack_docs, "tokens": pack_tokens, "seconds": pack_s, "records_per_s": pack_docs / pack_s,
                     "tokens_per_s_per_cpu": pack_rate},
            "shuffle": {"rows": packed_rows, "mib": packed_bytes / 2**20, "seconds": shuffle_s,
                        "rows_per_s": packed_rows / shuffle_s, "mib_per_s": packed_bytes / 2**20 / shuffle_s},
        }
        print(json.dumps(figures))
    import ray

    ray.shutdown()
    shutil.rmtree(local_ray["temp_dir"], ignore_errors=True)
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
