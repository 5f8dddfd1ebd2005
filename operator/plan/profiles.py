"""Which model profile an InferenceService is sized with, and where its numbers came from: the catalog
entry named by profile.base or matched by the URI, else (for hf:// models) the repo's config.json at
the revision asked for, overridden in either case by spec.model.profile."""

from tokenmill.operator.observe.hub import HubError, HubModel
from tokenmill.operator.plan.catalog import (
    REQUIRED_FIELDS,
    SPEC_KEYS,
    ModelProfile,
    ProfileError,
    find_model_profile,
    profile_from_hf_config,
    profile_from_spec,
)
from tokenmill.operator.plan.spec import ServiceSpec


def catalog_base(spec: ServiceSpec) -> ModelProfile | None:
    """The catalog profile named by profile.base, or matched by the URI (without @REVISION)."""
    base_name = (spec.profile or {}).get("base")
    base = find_model_profile(base_name or spec.model_name)
    if base_name and base is None:
        raise ProfileError("UnknownModelProfile", f"profile.base {base_name!r} is not in the catalog")
    return base


def resolve_profile(spec: ServiceSpec, hub_model: HubModel | None = None) -> ModelProfile:
    """Catalog entry (or the hub's config.json when the catalog has none), overridden by spec.model.profile."""
    given = dict(spec.profile or {})
    given.pop("base", None)
    base = catalog_base(spec)
    if base is None and hub_model is not None and hub_model.config is not None:
        base = profile_from_hf_config(hub_model.config, hub_model.repo_id, num_parameters=hub_model.parameters,
                                      source="hub")
    return profile_from_spec(given, base, spec.served_model_name)


def hub_status(hub_model: HubModel, profile: ModelProfile | None) -> dict:
    """status.sizing.hub: the repo and commit the plan describes, and which numbers came from it."""
    out = {"repo": hub_model.repo_id, "revision": hub_model.revision, "commit": hub_model.commit,
           "gated": hub_model.gated}
    if hub_model.weights_bytes is not None:
        out["weightsBytes"] = hub_model.weights_bytes
    if profile is not None and profile.source.startswith("hub"):
        out["configFile"] = f"config.json at {hub_model.commit}"
        out["parametersFrom"] = "safetensors metadata" if hub_model.parameters else "estimated from config.json"
    return out


def needs_hub_config(spec: ServiceSpec) -> bool:
    """Whether sizing needs the repo's config.json: no catalog base, and spec.model.profile lacks numbers."""
    if catalog_base(spec) is not None:
        return False
    given = spec.profile or {}
    return any(given.get(SPEC_KEYS[f]) is None for f in REQUIRED_FIELDS)


def resolve_with_hub(spec: ServiceSpec, lookup) -> tuple[ModelProfile, HubModel | None]:
    """The profile of any model; for hf:// ones `lookup(with_config)` asks the Hub first, so a gated
    repo without a token, a missing repo or revision become a ProfileError with the hub's reason. An
    unreachable Hub stops only models the catalog (or the spec) cannot size without it."""
    if spec.model_scheme != "hf" or lookup is None:
        return resolve_profile(spec), None
    with_config = needs_hub_config(spec)
    try:
        hub_model = lookup(with_config)
    except HubError as e:
        if e.reason == "HubUnreachable" and not with_config:
            return resolve_profile(spec), None  # the engine will try the Hub itself
        raise ProfileError(e.reason, str(e)) from None
    if hub_model is None:  # the lookup could not be made (a gated repo whose token it may not read)
        return resolve_profile(spec), None
    return resolve_profile(spec, hub_model), hub_model
