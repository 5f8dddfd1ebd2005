"""Which tensor x pipeline parallel splits a model and a machine can run: the one source of these rules.

Torch-free on purpose: `tokenmill serve` checks the sizes while parsing its arguments (before any heavy
import), `tokenmill serve --check` (preflight.py) and the engine core (parallel_state.validate_parallel)
check the model and the devices with the same functions, before any weight is read. Every message
names the numbers.
"""


def check_parallel_shape(t: int, p: int, nnodes: int = 1) -> None:
    """Sizes of at least 1, and T x P ranks that split evenly over the nodes (no model needed)."""
    if t < 1 or p < 1:
        raise ValueError(
            f"tensor_parallel_size and pipeline_parallel_size must be at least 1; got {t} and {p}"
        )
    if nnodes < 1 or (t * p) % nnodes:
        raise ValueError(
            f"{t * p} ranks (tensor_parallel_size={t} x pipeline_parallel_size={p}) do not split evenly "
            f"over {nnodes} nodes"
        )


def tp_fits_model(num_heads: int, num_kv_heads: int, intermediate_size: int, t: int) -> bool:
    """T divides the attention heads and the MLP width, and divides the KV heads or is a multiple of
    them (then they are replicated)."""
    kv_ok = num_kv_heads % t == 0 or t % num_kv_heads == 0
    return num_heads % t == 0 and intermediate_size % t == 0 and kv_ok


def check_parallel_model(
    t: int, p: int, num_heads: int, num_kv_heads: int, intermediate_size: int, num_layers: int
) -> None:
    """Whole heads per rank, an even slice of the MLP width per rank, at least one layer per stage."""
    if num_heads % t:
        fits = [
            d for d in range(1, num_heads + 1) if tp_fits_model(num_heads, num_kv_heads, intermediate_size, d)
        ]
        raise ValueError(
            f"tensor_parallel_size={t} does not divide the model's {num_heads} attention heads; use one of {fits}"
        )
    if num_kv_heads % t and t % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={t} neither divides the model's {num_kv_heads} KV heads nor is a multiple "
            "of them (KV heads are split evenly or replicated)"
        )
    if intermediate_size % t:
        raise ValueError(
            f"tensor_parallel_size={t} does not divide the model's MLP width {intermediate_size}"
        )
    if p > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={p} is more than the model's {num_layers} layers (every stage needs at least one)"
        )


def check_parallel_devices(t: int, p: int, nnodes: int, gpus_present: int) -> None:
    """One GPU per rank: T x P / nodes GPUs on this node."""
    per_node = t * p // nnodes
    if per_node > gpus_present:
        raise ValueError(
            f"tensor_parallel_size={t} x pipeline_parallel_size={p} needs {per_node} GPUs per node "
            f"({nnodes} node(s)), but {gpus_present} are present"
        )
