"""The messages between the front end and the engine core, and their encoding.

Messages are tuples whose first element is the kind; on the wire (ZeroMQ between processes) they are
msgpack arrays of plain fields. The same tuples travel unencoded through the in-process client's queues,
so proc.py's busy loop is the only one, whichever side of a process boundary it runs on.
"""

import dataclasses
from typing import Any

import msgpack
from tokenmill.engine.core import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tokenmill.engine.lora_request import LoRARequest
from tokenmill.engine.sampling_params import SamplingParams

# API process -> core. UTILITY: (UTILITY, call id, method, args), a call of one of EngineCore's
# UTILITY_METHODS between steps (vLLM's utility requests), answered by one UTILITY_RESULT.
ADD, ABORT, SHUTDOWN, UTILITY = "add", "abort", "shutdown", "utility"
# core -> API process. UTILITY_RESULT: (UTILITY_RESULT, call id, ok, the method's result or the error).
READY, STARTUP_ERROR, OUTPUTS, REJECT, FATAL = "ready", "startup_error", "outputs", "reject", "fatal"
UTILITY_RESULT = "utility_result"
# The EngineCore methods a UTILITY message may call (plain arguments and results: they cross as msgpack).
UTILITY_METHODS = frozenset({"reset_prefix_cache"})


_OUTPUT_FIELDS = [f.name for f in dataclasses.fields(EngineCoreOutput)]



_STATS_FIELDS = [f.name for f in dataclasses.fields(SchedulerStats)]



def _lora_fields(lora: LoRARequest) -> tuple[str, int, str]:
    return (lora.lora_name, lora.lora_int_id, lora.lora_path)


# ---- wire format ---------------------------------------------------------------------------------
def encode(msg: tuple) -> bytes:
    kind = msg[0]
    if kind == ADD:
        r: EngineCoreRequest = msg[1]
        body: list[Any] = [
            r.request_id,
            r.prompt_token_ids,
            r.sampling_params.to_dict(),
            r.arrival_time,
            r.priority,
            r.cache_salt,
            None if r.lora_request is None else list(_lora_fields(r.lora_request)),
        ]
        return msgpack.packb([ADD, body])
    if kind == OUTPUTS:
        outputs = [[getattr(o, f) for f in _OUTPUT_FIELDS] for o in msg[1]]
        stats = [getattr(msg[2], f) for f in _STATS_FIELDS]
        return msgpack.packb([OUTPUTS, outputs, stats])
    if kind == READY:
        return msgpack.packb([READY, dataclasses.asdict(msg[1]), list(msg[2])])
    return msgpack.packb(list(msg))



def decode(buf: bytes) -> tuple:
    msg = msgpack.unpackb(buf, strict_map_key=False)
    kind = msg[0]
    if kind == ADD:
        rid, ids, params, arrival, priority, salt, lora = msg[1]
        lora_request = None if lora is None else LoRARequest(*lora)
        return (ADD, EngineCoreRequest(rid, ids, SamplingParams.from_dict(params), arrival, priority, salt, lora_request))
    if kind == OUTPUTS:
        outputs = [EngineCoreOutput(*fields) for fields in msg[1]]
        for o in outputs:
            if o.new_logprobs is not None:  # msgpack turns tuples into lists; restore TokenLogprobs
                o.new_logprobs = [(lp, [(t, tlp) for t, tlp in top]) for lp, top in o.new_logprobs]
        stats = SchedulerStats(*msg[2])
        stats.queue_times = [(rid, waited) for rid, waited in stats.queue_times]
        return (OUTPUTS, outputs, stats)
    if kind == READY:
        from tokenmill.engine.core.capacity import EngineCapacity  # imports no torch

        return (READY, EngineCapacity(**msg[1]), msg[2])
    return tuple(msg)
