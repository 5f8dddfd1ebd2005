"""LoRA adapters on one base model: PEFT folders read and checked (peft.py, torch-free: the API process
checks an adapter before the engine sees it), their weights sharded and fused into the slot layout
(weights.py), and each rank's slots and host cache (manager.py). The grouped product is
engine/layers/lora.py's; the scheduler keeps a step within the slots (core/scheduler.py).
This package's __init__ imports nothing: the API process imports peft.py without torch."""
