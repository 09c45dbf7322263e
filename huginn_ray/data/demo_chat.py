"""The demo's chat set: question/answer pairs made from the docstrings of the Python standard-library modules the
demo pretrains on, so `make demo` can fine-tune on conversations offline.

    python -m huginn_ray.data.demo_chat out/demo_chat/conversations [--count 64]

Every public function and class of the demo's modules (json, email, unittest, asyncio; files and definitions in
sorted order) that has a docstring gives one conversation: the user asks "What does `module.name` do?" and Huginn
answers with the docstring's first paragraph (whitespace collapsed, cut at a sentence end within ANSWER_CHARS).
The first `count` of them, taken round-robin over the modules, are written as `chat.jsonl` (fields `question`,
`answer`), the input of configs/data/demo_chat.yaml. The set is a function of this interpreter's standard
library only.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

MODULES = ("json", "email", "unittest", "asyncio")
"""The packages of configs/data/demo_sources.yaml."""
ANSWER_CHARS = 300
"""Longest answer: the first paragraph is cut at its last sentence end before this many characters."""


def _answer(docstring: str) -> str:
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    if len(paragraph) <= ANSWER_CHARS:
        return paragraph
    cut = paragraph[:ANSWER_CHARS]
    end = cut.rfind(". ")
    return cut[:end + 1] if end > 0 else cut.rstrip() + "..."


def module_pairs(package: str) -> list[dict]:
    """(question, answer) of every documented public top-level function and class of a stdlib package."""
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    pairs = []
    for path in sorted(p for p in root.glob("*.py") if p.stem == "__init__" or not p.stem.startswith("_")):
        module = package if path.stem == "__init__" else f"{package}.{path.stem}"
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            docstring = ast.get_docstring(node)
            if node.name.startswith("_") or not docstring or not _answer(docstring):
                continue
            pairs.append({"question": f"What does `{module}.{node.name}` do?", "answer": _answer(docstring)})
    return pairs


def conversations(count: int) -> list[dict]:
    """The first `count` pairs, round-robin over MODULES (each module's in file and definition order)."""
    per_module = [module_pairs(m) for m in MODULES]
    chosen = []
    for i in range(max(len(p) for p in per_module)):
        chosen += [p[i] for p in per_module if i < len(p)]
    return chosen[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="directory to write chat.jsonl into")
    parser.add_argument("--count", type=int, default=64, help="conversations to write")
    args = parser.parse_args(argv)
    pairs = conversations(args.count)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "chat.jsonl", "w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair, ensure_ascii=False) + "\n")
    print(f"[demo_chat] {len(pairs)} question/answer conversations from the docstrings of "
          f"{', '.join(MODULES)} -> {out / 'chat.jsonl'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
