"""Who asks the Hub: the name a Hub client gives in its User-Agent ("tokenmill-operator/0.1.0; hf_hub/...").

A leaf (standard library only): the engine's downloads (model/hub_download.py) and the operator's sizing
lookups (operator/observe/hub.py) both use it, and the operator's image has no torch.
"""

# A Hub's logs (and the tests' stand-in) tell the operator's sizing lookups from the engines' downloads.
ENGINE_CLIENT = "tokenmill"
OPERATOR_CLIENT = "tokenmill-operator"


def hub_client(name: str) -> dict[str, str]:
    """huggingface_hub's library_name / library_version arguments naming `name` at this package's version."""
    from importlib import metadata

    try:
        version = metadata.version("tokenmill")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"library_name": name, "library_version": version}
