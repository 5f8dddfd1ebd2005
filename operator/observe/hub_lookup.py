"""The Hub asked about one InferenceService's hf:// model, with the token of its spec.model.tokenSecretRef."""

from tokenmill.operator.kube import KubeError
from tokenmill.operator.observe.hub import HubCache, parse_hf_uri
from tokenmill.operator.observe.secrets import secret_problem
from tokenmill.operator.plan.observations import HubAnswer, HubError, HubModel
from tokenmill.operator.plan.spec import ServiceSpec


def ask_hub(api, spec: ServiceSpec, hub: HubCache, hf_endpoint: str | None,
            with_config: bool | None) -> HubAnswer | None:
    """What the Hub says; None when nothing is to be asked (`with_config` is plan.profiles.hub_question's
    answer). A failed lookup is an answer too: the plan decides what it means."""
    if with_config is None:
        return None
    try:
        return HubAnswer(with_config, model=_lookup(api, spec, hub, hf_endpoint, with_config))
    except HubError as e:
        return HubAnswer(with_config, error=e)


def _lookup(api, spec: ServiceSpec, hub: HubCache, hf_endpoint: str | None, with_config: bool) -> HubModel | None:
    repo, revision = parse_hf_uri(spec.model_uri)
    token, unreadable = None, False
    if spec.token_secret is not None:
        try:
            token = api.secret_value(spec.namespace, *spec.token_secret)
        except KubeError as e:
            if e.status != 403:
                raise
            unreadable = True  # not allowed to read Secrets here: ask without the token
        else:
            if token is None:  # say that, not "gated" (which the Hub would answer without a token)
                raise HubError("SecretNotFound", secret_problem(api, spec.namespace, *spec.token_secret,
                                                                "spec.model.tokenSecretRef") or "")
    try:
        return hub.lookup(repo, revision, token, hf_endpoint, with_config)
    except HubError as e:
        if e.reason != "GatedModel" or not unreadable:
            raise
        if not with_config:
            return None  # the pods get the token; the catalog sizes the model
        name = spec.token_secret[0]
        raise HubError("GatedModel", f"{e}; the operator may not read Secret {name} to fetch config.json: "
                                     f"add {name} to the chart value rbac.secretNames (default [hf-token]), "
                                     "or set spec.model.profile") from None
