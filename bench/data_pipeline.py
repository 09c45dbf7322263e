"""Data pipeline throughput: tokenize+pack tokens/s per CPU core vs raw `tokenizers` encode_batch, and shuffle MB/s.

    python bench/data_pipeline.py [--mib 64] [--cpus 2] [--vocab 16384] [--seq-len 4096] [--out /tmp/hr_bench]

Builds a local source of Python standard-library text (each file repeated with a distinct header until --mib
MiB), stages it, trains a tokenizer on a slice of it, then measures side by side in one run:
  raw   - one process, one thread: Tokenizer.encode_batch_fast over the staged documents in batches;
  pack  - the pack stage on a local Ray with --cpus CPUs (read + encode + hold-out + pack + write);
  shuffle - the shuffle stage over the packed rows (map/reduce into 2*num_shards files).
Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from huginn_ray.data.config import load_data_config
from huginn_ray.data.pipeline import init_ray, run
from huginn_ray.data.tokenizer import train_tokenizer


def build_corpus(root: Path, mib: int) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.rglob("*.py")):
        try:
            texts.append(path.read_text(encoding="utf-8")[:32768])
        except (UnicodeDecodeError, OSError):
            continue
    root.mkdir(parents=True, exist_ok=True)
    target, written, part, rep = mib << 20, 0, 0, 0
    out = open(root / f"part{part:03d}.jsonl", "w")
    while written < target:
        for i, text in enumerate(texts):
            line = json.dumps({"text": f"# copy {rep} of file {i}\n{text}"}) + "\n"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--cpus", type=int, default=os.cpu_count())
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--docs-per-batch", type=int, default=1024)
    parser.add_argument("--object-store-mib", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    root = Path(args.out or tempfile.mkdtemp(prefix="hr_bench_"))
    build_corpus(root / "corpus", args.mib)
    (root / "sources.yaml").write_text(f"- {{name: stdlib, local_dir: {root / 'corpus'}, features: [text]}}\n")
    local_ray = {"num_cpus": args.cpus, "object_store_mib": args.object_store_mib,
                 "temp_dir": tempfile.mkdtemp(prefix="hrb_", dir="/tmp")}
    (root / "data.yaml").write_text(json.dumps({
        "output_dir": str(root / "out"), "sources": str(root / "sources.yaml"), "seq_len": args.seq_len,
        "num_shards": args.num_shards, "docs_per_pack_batch": args.docs_per_batch, "local_ray": local_ray}))
    cfg = load_data_config(root / "data.yaml")
    init_ray(cfg)
    run(cfg, ("staging",))
    staged = sorted((root / "out" / "staging" / "stdlib").glob("*.parquet"))
    texts = [t for f in staged for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    corpus_bytes = sum(len(t.encode()) for t in texts)
    train_tokenizer(_first_mib(texts, 8), args.vocab, cfg.tokenizer_dir)

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(cfg.tokenizer_dir / "tokenizer.json"))
    start, raw_tokens = time.perf_counter(), 0
    for i in range(0, len(texts), cfg.docs_per_pack_batch):
        raw_tokens += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + cfg.docs_per_pack_batch]))
    raw_s = time.perf_counter() - start
    del texts

    start = time.perf_counter()
    marker = run(cfg, ("pack",))
    pack_s = time.perf_counter() - start
    packed_bytes = sum(p.stat().st_size for p in (root / "out" / "packed").glob("*.parquet"))
    start = time.perf_counter()
    run(cfg, ("shuffle",))
    shuffle_s = time.perf_counter() - start

    pack_tokens = sum(s["doc_tokens"] for s in marker["sources"].values())
    raw_rate = raw_tokens / raw_s
    pack_rate = pack_tokens / pack_s / args.cpus
    print("\n=== data pipeline benchmark ===")
    print(f"corpus: {corpus_bytes / 2**20:.0f} MiB text, {raw_tokens / 1e6:.1f}M tokens, vocab {args.vocab}, "
          f"seq_len {args.seq_len}, {args.cpus} Ray CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"raw encode_batch_fast (1 process, 1 thread): {raw_rate / 1e3:.0f}k tokens/s")
    print(f"pack stage: {pack_tokens / 1e6:.1f}M tokens in {pack_s:.1f}s = {pack_rate / 1e3:.0f}k tokens/s per CPU "
          f"({pack_rate / raw_rate:.0%} of raw)")
    print(f"shuffle stage: {packed_bytes / 2**20:.0f} MiB packed in {shuffle_s:.1f}s = "
          f"{packed_bytes / 2**20 / shuffle_s:.1f} MiB/s")
    import ray

    ray.shutdown()
    shutil.rmtree(local_ray["temp_dir"], ignore_errors=True)
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
