"""`tokenmill bench lora`: output tokens/s of a batch whose rows are spread over several LoRA adapters,
against the same batch on the base model alone, in one engine and one command (rounds interleaved, so both
see the same machine).

Without --adapters it writes random adapters in PEFT's layout (adapter_config.json,
adapter_model.safetensors: every q/k/v/o/gate/up/down target at --rank), which cost what trained ones do.
Every run draws new prompts, so no run reads another's prefix blocks.
"""

import json
import pathlib
import tempfile
import time
from typing import Any

from tokenmill.engine.lora_memory import LORA_TARGET_MODULES


def write_random_adapter(model_dir: pathlib.Path, out: pathlib.Path, rank: int, seed: int, std: float = 0.02) -> pathlib.Path:
    """A random LoRA adapter for the model at model_dir in PEFT's files and names."""
    import torch
    from tokenmill.engine.lora.peft import module_shapes
    from tokenmill.engine.model.safetensors_stream import write_safetensors
    from tokenmill.engine.model_config import load_model_config

    mc = load_model_config(model_dir)
    shapes = module_shapes(mc)
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGET_MODULES),
              "bias": "none", "use_rslora": False, "use_dora": False}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    specs = {}
    for layer in range(mc.num_hidden_layers):
        for module in LORA_TARGET_MODULES:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fan_in, fan_out = shapes[module]
            stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
            specs[f"{stem}.lora_A.weight"] = (torch.float32, (rank, fan_in))
            specs[f"{stem}.lora_B.weight"] = (torch.float32, (fan_out, rank))
    gen = torch.Generator().manual_seed(seed)
    write_safetensors(out / "adapter_model.safetensors", specs, lambda name: torch.randn(specs[name][1], generator=gen) * std)
    return out


def _run(llm: Any, batch: int, max_tokens: int, prompt_len: int, loras: list[Any], seed: int) -> dict[str, Any]:
    import numpy as np
    from tokenmill.engine import SamplingParams

    vocab = llm.engine.core.model_config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(batch)]
    per_row = [loras[i % len(loras)] for i in range(batch)] if loras else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_stats()
    t0 = time.perf_counter()
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False, lora_request=per_row)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != batch * max_tokens:
        raise RuntimeError(f"expected {batch * max_tokens} tokens, got {tokens}")
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "num_steps": llm.stats()["num_steps"]}


def run_lora_bench(
    llm: Any, adapters: list[pathlib.Path] | None, num_adapters: int, rank: int, batches: list[int], max_tokens: int,
    prompt_len: int, rounds: int,
) -> dict[str, Any]:  # fmt: skip
    """Per batch size: the best of `rounds` interleaved runs of the base model alone and of the batch mixed
    over the adapters (row i under adapter i mod N)."""
    from tokenmill.engine import LoRARequest

    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-lora-") as tmp:
        if not adapters:
            model_dir = llm.engine.core.model_path
            adapters = [write_random_adapter(model_dir, pathlib.Path(tmp) / f"a{i}", rank, seed=i) for i in range(num_adapters)]
        loras = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
        _run(llm, len(loras), 4, 8, loras, seed=2**31)  # warm up: kernels, every adapter read and slotted once
        rows, seed = [], 0
        for batch in batches:
            base, mixed = [], []
            for _ in range(rounds):
                base.append(_run(llm, batch, max_tokens, prompt_len, [], seed))
                mixed.append(_run(llm, batch, max_tokens, prompt_len, loras, seed + 1))
                seed += 2
            b = max(r["tokens_per_s"] for r in base)
            m = max(r["tokens_per_s"] for r in mixed)
            rows.append({"batch": batch, "base_tokens_per_s": b, "lora_tokens_per_s": m, "lora_vs_base": m / b,
                         "base_runs": [r["tokens_per_s"] for r in base], "lora_runs": [r["tokens_per_s"] for r in mixed]})  # fmt: skip
    return {"adapters": len(loras), "max_lora_rank": llm.engine.core.config.max_lora_rank, "max_tokens": max_tokens,
            "prompt_len": prompt_len, "rounds": rounds, "rows": rows}  # fmt: skip
