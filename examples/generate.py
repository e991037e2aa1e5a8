"""Generate text token by token from a tiny-GPT checkpoint written by train_gpt.py, with the
per-layer key/value caches resident in the arena (one row written per token, never copied whole).

    python examples/generate.py [--ckpt gpt.safetensors] [--prompt "def "] [--tokens 60]
"""

from __future__ import annotations

import argparse
import time

import rlx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="gpt.safetensors")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    rlx.seed(args.seed)
    model = rlx.models.GPT()
    model.load(args.ckpt)
    gen = rlx.models.Generator(model, device=args.device)
    prompt = list(args.prompt.encode("utf-8"))
    n = min(args.tokens, gen.max_len - len(prompt))
    t = time.perf_counter()
    out = gen.generate(prompt, n, temperature=args.temperature)
    dt = time.perf_counter() - t
    print(bytes(out).decode("utf-8", errors="replace"))
    print(f"--- {len(out)} tokens in {dt * 1e3:.1f} ms: {len(out) / dt:.0f} tokens/s "
          f"(context limit {gen.max_len})")


if __name__ == "__main__":
    main()
