"""`tokenmill generate "prompt"`: print a completion from a model (the bundled one by default)."""

import argparse
import sys

from tokenmill.engine.sampling_params import SamplingParams


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tokenmill generate", description=__doc__)
    ap.add_argument("prompt", help="the prompt text")
    ap.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)")
    ap.add_argument("--chat", action="store_true", help="treat the prompt as a user message (chat template)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)

    from tokenmill.engine.llm import LLM

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenmill generate: {e}", file=sys.stderr)
        return 2
    print(out.outputs[0].text)
    return 0
