"""Train the BPE tokenizer on a corpus drawn from the sources of a data config.

    python jobs/train_tokenizer.py --config configs/data/demo.yaml [key=value ...]

Runs the download and staging stages of jobs/prepare_data.py if needed (their outputs are reused there), then
trains bpeasy BPE with the `aeolian` regex and writes tokenizer.json + tokenizer_config.json to tokenizer.path
(default <output_dir>/tokenizer). A tokenizer trained from the same corpus settings is kept unless --force.
It holds `<output_dir>/LOCK` as jobs/prepare_data.py does: one driver per output_dir.
"""

from __future__ import annotations

import argparse
import sys
import time

from huginn_ray import storage
from huginn_ray.config import ConfigError
from huginn_ray.data import layout
from huginn_ray.data.config import load_data_config
from huginn_ray.data.pipeline import init_ray, print_last_error, root_error, run, staging_markers
from huginn_ray.data.sources import load_sources
from huginn_ray.data.staging import staged_files
from huginn_ray.data.tokenizer import special_token_ids, train_tokenizer
from huginn_ray.data.tokenizer_corpus import corpus_texts
from huginn_ray.train.runlock import RunLock, RunLockError

TRAINING_RECORD = "training.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="data config YAML (see configs/data/)")
    parser.add_argument("--force", action="store_true", help="retrain even if an identical tokenizer exists")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. tokenizer.vocab_size=4096")
    args = parser.parse_args(argv)
    try:
        cfg = load_data_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"train_tokenizer: config error: {err}", file=sys.stderr)
        return 2
    if storage.is_uri(cfg.tokenizer.path):  # read through a local copy, which a training would overwrite
        print(f"train_tokenizer: config error: tokenizer.path: {cfg.tokenizer.path} is in object storage, where a "
              f"tokenizer is read, not trained: leave tokenizer.path empty (<output_dir>/tokenizer)", file=sys.stderr)
        return 2
    lock = RunLock(cfg.root)  # one driver per output_dir (prepare_data.py takes the same), before Ray starts
    try:
        message = lock.acquire()
    except RunLockError as err:
        print(f"train_tokenizer: error: {err}", file=sys.stderr)
        return 1
    if message:
        print(f"train_tokenizer: {message}", flush=True)
    stop_ray, error = None, None
    try:
        stop_ray = init_ray(cfg)
        run(cfg, ("download", "staging"))
        sources = load_sources(cfg.sources)
        markers = staging_markers(cfg, sources)
        settings = {"vocab_size": cfg.tokenizer.vocab_size, "manual_tokens": cfg.tokenizer.manual_tokens,
                    "rows_per_source": cfg.tokenizer.rows_per_source, "seed": cfg.seed,
                    "max_chars_per_doc": cfg.tokenizer.max_chars_per_doc,
                    "max_token_length": cfg.tokenizer.max_token_length, "corpus": 3,
                    "staged": {name: m["fingerprint"] for name, m in markers.items()}}
        fingerprint = layout.fingerprint(settings)
        out_dir = cfg.tokenizer_dir
        if not args.force and layout.is_complete(out_dir, fingerprint, TRAINING_RECORD):
            print(f"train_tokenizer: {out_dir} was trained from the same corpus settings, kept", flush=True)
            return 0
        start = time.time()
        staged = {s.name: staged_files(cfg.root / "staging", s.name) for s in sources}
        staged = {name: files for name, files in staged.items()
                  if next(s for s in sources if s.name == name).weight > 0}
        texts = corpus_texts(staged, cfg.tokenizer.rows_per_source, cfg.tokenizer.max_chars_per_doc, cfg.seed,
                             frozenset(s.name for s in sources if s.needs_chat_templating),
                             frozenset(s.name for s in sources if s.is_chat))
        counted = _Counter(texts)
        print(f"==> training BPE (vocab_size={cfg.tokenizer.vocab_size}) with bpeasy", flush=True)
        train_tokenizer(counted, cfg.tokenizer.vocab_size, out_dir, use_manual_tokens=cfg.tokenizer.manual_tokens,
                        max_token_length=cfg.tokenizer.max_token_length)
        layout.write_json(out_dir / TRAINING_RECORD, {"fingerprint": fingerprint, "settings": settings,
                                                     "documents": counted.docs, "characters": counted.chars})
    except Exception as err:
        error = str(root_error(err))
    finally:
        if stop_ray is not None:
            stop_ray()
        lock.release()
    if error is not None:
        print_last_error("train_tokenizer", error)
        return 1
    ids = special_token_ids(out_dir)
    print(f"train_tokenizer: {out_dir} ({ids['vocab_size']} ids, BOS {ids['bos']}, EOS {ids['eos']}, "
          f"pad {ids['pad']}) from {counted.docs} documents / {counted.chars / 1e6:.1f}M chars "
          f"in {time.time() - start:.1f}s", flush=True)
    return 0


class _Counter:
    """Passes texts through to bpeasy while counting them for the training record."""

    def __init__(self, texts):
        self.texts, self.docs, self.chars = texts, 0, 0

    def __iter__(self):
        for text in self.texts:
            self.docs += 1
            self.chars += len(text)
            yield text


if __name__ == "__main__":
    sys.exit(main())
