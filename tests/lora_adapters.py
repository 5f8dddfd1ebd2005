"""Test helpers: LoRA adapters made by PEFT itself on a saved base model, and PEFT's greedy tokens under them
(the reference the engine's adapter rows must equal)."""

import pathlib

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base_dir: pathlib.Path,
    out: pathlib.Path,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    std: float = 0.1,
) -> pathlib.Path:
    """A PEFT LoRA adapter for the model at base_dir, saved by PEFT's save_pretrained (adapter_config.json,
    adapter_model.safetensors). A and B are drawn with `std` (PEFT inits B to zero, which changes nothing),
    large enough that greedy tokens differ from the base model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=use_rslora)  # fmt: skip
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(
    base_dir: pathlib.Path, adapter_dir: pathlib.Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """transformers (+ PEFT when adapter_dir is given) greedy tokens in fp32, max_tokens each (EOS ignored)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        outs.append(y[0, len(ids) :].tolist())
    return outs
