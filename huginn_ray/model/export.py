"""Export a checkpoint as a self-contained Hugging Face model directory.

    python -m huginn_ray.model.export --checkpoint DIR --out OUT [--tokenizer TOKENIZER_DIR]

DIR, OUT and TOKENIZER_DIR may be in a bucket (`s3://...`). DIR and TOKENIZER_DIR are read through this node's
cache (huginn_ray/model_cache.py); an OUT in a bucket is written to a local temporary directory first and uploaded
with config.json last, so a reader that finds config.json finds the whole export.

OUT holds config.json (the released Huginn-0125 keys plus model_type, architectures, auto_map,
num_hidden_layers), model.safetensors (the released key layout, fp32), generation_config.json (stopping at
<|end_text|> and <|end_turn|>, as the release's), the tokenizer files with the chat template
(huginn_ray.data.chat.CHAT_TEMPLATE) in tokenizer_config.json, and configuration_huginn_ray.py /
modeling_huginn_ray.py, which import only torch and transformers:

    model = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
    model(input_ids, num_steps=32, input_states=s0); model.generate(input_ids, num_steps=16, max_new_tokens=20)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from huginn_ray.model.model import RecurrentGPT
from huginn_ray import storage
from huginn_ray.model.pretrained import CONFIG_NAME, load_pretrained
from huginn_ray.model_cache import in_bucket, local_dir, local_model_dir

HF_CODE = Path(__file__).parent / "hf"
CODE_FILES = ("configuration_huginn_ray.py", "modeling_huginn_ray.py")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
AUTO_MAP = {
    "AutoConfig": "configuration_huginn_ray.RavenConfig",
    "AutoModelForCausalLM": "modeling_huginn_ray.RavenForCausalLM",
}


def export(model: RecurrentGPT, out: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    special = _special_ids(tokenizer_dir, cfg.vocab_size)
    end_turn = _end_turn_id(tokenizer_dir)
    try:
        import transformers
        version = transformers.__version__
    except ImportError:
        version = "4.47.1"
    config = {
        **cfg.to_hf_dict(),
        "architectures": ["RavenForCausalLM"],
        "auto_map": AUTO_MAP,
        "model_type": "huginn_raven",
        "num_hidden_layers": cfg.n_layers_in_prelude + cfg.n_layers_in_coda
        + cfg.n_layers_in_recurrent_block * cfg.mean_recurrence,
        "torch_dtype": "float32",
        "transformers_version": version,
        "test_time_noise_type": "fixed",
        "activation_checkpoint_impl": "per-iteration",
        **{f"{name}_token_id": value for name, value in special.items()},
    }
    del config["name"], config["activation_checkpointing"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"do_sample": False, "transformers_version": version,
                  **{f"{name}_token_id": value for name, value in special.items()}}
    if end_turn is not None:  # a chat reply ends its turn: stop there too, as the released generation config does
        generation["eos_token_id"] = [special["eos"], end_turn]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    # Both tied keys are stored (safetensors refuses shared tensors), as in the released checkpoint.
    tensors = {key: value.detach().to("cpu", torch.float32).contiguous().clone()
               for key, value in model.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in CODE_FILES:
        shutil.copyfile(HF_CODE / name, out / name)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, out / name)
        _add_chat_template(out / "tokenizer_config.json")
    return out


def _add_chat_template(path: Path) -> None:
    """The chat template the project's chat data is rendered with (huginn_ray.data.chat), for apply_chat_template."""
    from huginn_ray.data.chat import CHAT_TEMPLATE

    config = json.loads(path.read_text()) if path.is_file() else {}
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2) + "\n")


def _special_ids(tokenizer_dir, vocab_size: int) -> dict[str, int]:
    if tokenizer_dir is None:
        return {}
    from huginn_ray.data.tokenizer import check_tokenizer_fits, special_token_ids

    check_tokenizer_fits(tokenizer_dir, vocab_size)
    ids = special_token_ids(tokenizer_dir)
    return {"bos": ids["bos"], "eos": ids["eos"], "pad": ids["pad"]}


def _end_turn_id(tokenizer_dir) -> int | None:
    """<|end_turn|>'s id, None without a tokenizer or for one without the chat tokens (plain text only)."""
    if tokenizer_dir is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).token_to_id("<|end_turn|>")


def find_tokenizer(checkpoint: Path) -> Path | None:
    """A tokenizer stored with the model, or the one named by the training run's resolved config."""
    for candidate in (checkpoint, checkpoint / "tokenizer", checkpoint.parent / "tokenizer"):
        if (candidate / "tokenizer.json").is_file():
            return candidate
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="model dir, training checkpoint, or training out_dir")
    parser.add_argument("--out", required=True, help="directory or bucket prefix to write the Hugging Face model into")
    parser.add_argument("--tokenizer", help="tokenizer directory (tokenizer.json + tokenizer_config.json)")
    args = parser.parse_args(argv)
    try:
        if in_bucket(args.out):
            storage.check_location(args.out, "--out")
        model_dir = local_model_dir(args.checkpoint, log=print)
        model = load_pretrained(model_dir)
        tokenizer = local_dir(args.tokenizer, "--tokenizer") if args.tokenizer else find_tokenizer(model_dir)
        out = upload_export(model, args.out, tokenizer) if in_bucket(args.out) else export(model, args.out, tokenizer)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[huginn] exported {args.checkpoint if in_bucket(args.checkpoint) else model_dir} to {out}"
          + ("" if tokenizer else " (no tokenizer: pass --tokenizer)"))
    return 0


def upload_export(model: RecurrentGPT, location: str, tokenizer_dir: str | Path | None) -> str:
    """The export written to a local temporary directory, then uploaded under the bucket prefix `location` with
    config.json last (the loaders take a directory by its config.json)."""
    with tempfile.TemporaryDirectory(prefix="huginn-export-") as local:
        export(model, local, tokenizer_dir)
        storage.upload_dir(local, location, last=CONFIG_NAME)
    return location


if __name__ == "__main__":
    sys.exit(main())
