"""Which model profile an InferenceService is sized with: the catalog entry named by profile.base or
matched by the URI, overridden by spec.model.profile."""

from tokenmill.operator.catalog import ModelProfile, ProfileError, find_model_profile, profile_from_spec
from tokenmill.operator.spec import ServiceSpec


def resolve_profile(spec: ServiceSpec) -> ModelProfile:
    """Catalog entry named by profile.base or matched by the uri, overridden by spec.model.profile."""
    given = dict(spec.profile or {})
    base_name = given.pop("base", None)
    base = find_model_profile(base_name or spec.model_uri)
    if base_name and base is None:
        raise ProfileError("UnknownModelProfile", f"profile.base {base_name!r} is not in the catalog")
    return profile_from_spec(given, base, spec.served_model_name)
