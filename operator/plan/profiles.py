"""Which model profile an InferenceService is sized with, where its numbers came from, and the plan they
give: the catalog entry named by profile.base or matched by the URI, else (for hf:// models) the repo's
config.json at the revision asked for, overridden in either case by spec.model.profile."""

from dataclasses import dataclass

from tokenmill.operator.plan.catalog import (
    GPU_TYPES,
    REQUIRED_FIELDS,
    SPEC_KEYS,
    ModelProfile,
    ProfileError,
    find_model_profile,
    profile_from_hf_config,
    profile_from_spec,
)
from tokenmill.operator.plan.conditions import Condition
from tokenmill.operator.plan.observations import HubAnswer, HubModel
from tokenmill.operator.plan.sizing import SizingPlan, plan
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


def needs_hub_config(spec: ServiceSpec) -> bool:
    """Whether sizing needs the repo's config.json: no catalog base, and spec.model.profile lacks numbers."""
    if catalog_base(spec) is not None:
        return False
    given = spec.profile or {}
    return any(given.get(SPEC_KEYS[f]) is None for f in REQUIRED_FIELDS)


def hub_question(spec: ServiceSpec) -> bool | None:
    """What to ask the Hub: None for nothing (not hf://, or a profile.base the catalog lacks, which fails
    without a lookup), else whether config.json is needed too."""
    if spec.model_scheme != "hf":
        return None
    try:
        return needs_hub_config(spec)
    except ProfileError:
        return None  # resolve_profile raises it again, with no Hub asked


def resolve_with_hub(spec: ServiceSpec, answer: HubAnswer | None) -> tuple[ModelProfile, HubModel | None]:
    """The profile of any model; for hf:// ones after the Hub's answer, so a gated repo without a token, a
    missing repo or revision become a ProfileError with the hub's reason. An unreachable Hub stops only
    models the catalog (or the spec) cannot size without it."""
    if answer is None:
        return resolve_profile(spec), None
    if answer.error is not None:
        if answer.error.reason == "HubUnreachable" and not answer.with_config:
            return resolve_profile(spec), None  # the engine will try the Hub itself
        raise ProfileError(answer.error.reason, str(answer.error))
    if answer.model is None:  # the lookup could not be made (a gated repo whose token it may not read)
        return resolve_profile(spec), None
    return resolve_profile(spec, answer.model), answer.model


@dataclass(frozen=True, slots=True)
class Sized:
    """The sizing of one spec: the Sized condition, and the plan unless no profile could be found."""

    condition: Condition
    plan: SizingPlan | None = None
    profile: ModelProfile | None = None
    hub_model: HubModel | None = None
    error: ProfileError | None = None

    @property
    def feasible(self) -> bool:
        return self.plan is not None and self.plan.feasible


def size_service(spec: ServiceSpec, answer: HubAnswer | None) -> Sized:
    try:
        profile, hub_model = resolve_with_hub(spec, answer)
        p = plan(profile, GPU_TYPES[spec.gpu_type], spec.engine, spec.gpu_count)
    except ProfileError as e:
        # An unreachable Hub says nothing about the model: whether it fits is unknown, not no.
        status = "Unknown" if e.reason == "HubUnreachable" else "False"
        return Sized(Condition("Sized", status, e.reason, str(e)), error=e)
    return Sized(Condition("Sized", "True" if p.feasible else "False", p.reason, p.message), p, profile, hub_model)
