"""`make demo`: the whole pipeline on one machine, on the embedded defaults.

Until the data and training jobs land this runs what exists: a small recurrent-depth model trained for a
few steps on CPU at sampled depths, saved in the Hugging Face layout, reloaded, and used for generation.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from huginn_ray.model import ModelConfig, RecurrentGPT, load_pretrained, sample_recurrence, save_pretrained  # noqa: E402


def main() -> None:
    torch.manual_seed(233)
    config = ModelConfig.from_name("raven-tiny", vocab_size=256, block_size=64)
    model = RecurrentGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = (Path(torch.__file__).read_bytes()[:20000])  # any local bytes: a byte-level "tokenizer"
    tokens = torch.tensor(list(text), dtype=torch.long)
    print(f"model {config.name}: {sum(p.numel() for p in model.parameters()):,} parameters")
    for step in range(1, 31):
        n, k = sample_recurrence(step, config.mean_recurrence, config.mean_backprop_depth)
        starts = torch.randint(0, len(tokens) - 65, (8,))
        rows = torch.stack([tokens[s : s + 65] for s in starts])
        loss = model(rows[:, :-1], labels=rows[:, 1:], num_steps=(n, k)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0:
            print(f"step {step:3d}  depth n={n:2d} k={k}  loss {loss.item():.3f}")
    out_dir = Path(tempfile.mkdtemp(prefix="huginn_demo_"))
    save_pretrained(model, out_dir)
    reloaded = load_pretrained(out_dir).eval()
    prompt = tokens[:16][None]
    t0 = time.perf_counter()
    generated = reloaded.generate(prompt, max_new_tokens=32, num_steps=4)
    print(f"generated 32 tokens in {time.perf_counter() - t0:.2f}s with the KV cache: {generated[0, 16:].tolist()}")
    print(f"model saved to {out_dir} (model.safetensors + config.json)")


if __name__ == "__main__":
    main()
