"""What generate() raises -> the HTTP error the client sees."""

import logging

from tokenmill.engine.core.client import EngineDeadError
from tokenmill.engine.frontend.async_llm import RequestAbortedError, RequestRejectedError
from tokenmill.engine.server.errors import OpenAIError

logger = logging.getLogger(__name__)


def engine_error(err: BaseException) -> OpenAIError:
    """Map what generate() raises to the HTTP error the client sees."""
    if isinstance(err, EngineDeadError):
        return OpenAIError(
            500, f"the engine failed and the server is shutting down: {err}", code="engine_dead"
        )
    if isinstance(err, RequestRejectedError):
        return OpenAIError(400 if err.client_error else 500, str(err))
    if isinstance(err, RequestAbortedError):
        return OpenAIError(503, str(err), code="request_aborted")
    logger.error("request failed", exc_info=err)
    return OpenAIError(500, f"internal error: {type(err).__name__}: {err}")
