"""Whether this operator replica is the one that acts, by the rule Kopf's peering applies: a replica
pauses while the peering object lists a live peer with a higher priority, and every replica pauses
while two live peers share a priority. The per-object loops (handlers.py) are our own asyncio tasks,
not Kopf daemons (those would put a finalizer on every InferenceService), so they ask this before
each pass; Kopf pauses its watches by the same rule.

The peering object's status maps each peer's identity to {priority, lifetime, lastseen}.
"""

import datetime


def is_live(peer: dict, now: datetime.datetime) -> bool:
    try:
        seen = datetime.datetime.fromisoformat(str(peer["lastseen"]))
        lifetime = datetime.timedelta(seconds=int(peer.get("lifetime", 60)))
    except (KeyError, ValueError, TypeError):
        return False
    if seen.tzinfo is None:
        seen = seen.replace(tzinfo=datetime.UTC)
    return seen + lifetime > now


def acting(peering_status: dict | None, own_priority: int, now: datetime.datetime | None = None) -> bool:
    """True when no live peer outranks us and none but us has our priority."""
    now = now or datetime.datetime.now(datetime.UTC)
    live = [p for p in (peering_status or {}).values() if isinstance(p, dict) and is_live(p, now)]
    priorities = [int(p.get("priority", 0)) for p in live]
    return not any(p > own_priority for p in priorities) and priorities.count(own_priority) <= 1
