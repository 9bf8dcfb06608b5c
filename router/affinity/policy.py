"""The routing rule: which admitted candidate serves a request, best first.

Admission has already chosen who goes next and left out saturated and
ejected replicas; this only orders the candidates it was given, never drops
one (the proxy fails over down the list). The rule (docs/guides/routing.md):

- ``least_loaded``, a request without a prompt key, or under ``prefix`` a
  prompt shorter than ``min_match_tokens`` (its cached prefix is worth
  nothing: "hi" goes to every replica in turn): the candidates' own order,
  fewest in flight first.
- ``round_robin``: that order rotated by the request's turn.
- ``session``: rendezvous hash of the conversation's lead among the
  replicas within ``balance_slack`` of the least loaded.
- ``prefix``: among the replicas within the slack, the conversation's own
  replica (rendezvous hash of its lead), unless another holds at least
  ``min_match_tokens`` more of the prompt than it (the favourite counting
  as holding the prompt's head, what precedes the lead): then the one holding
  most (ties by rendezvous). Routers that never talked thus send a new
  conversation, and the turns of one they did not see, to the same
  replica; a shared system prompt pulls nowhere. When a replica past the
  slack held that much more than the chosen one, the reason is BALANCE.

  Hashing a few dozen conversations onto a few replicas is uneven, so under
  ``prefix`` the conversation's own replica is where this router placed it
  while it is live (router/affinity/homes.py), and a new one goes to the
  first replica in its rendezvous order with fewer live conversations than
  ``balance_factor`` times the mean, counting itself (``ceil``), looking
  past the slack if none within it is under: with 1, as even as whole
  conversations allow, and still the hash's choice whenever the counts are
  even. A live conversation on a replica over its share moves to one under
  it, whatever it holds. Placed off its hash's choice, or moved, the reason
  is BALANCE. 0 turns this off: the hash alone, on which routers that never
  talked agree for every conversation.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from llmgw.types import RoutingPolicy, RoutingPolicyKind
from router.affinity.chunks import PromptKey
from router.affinity.index import PrefixIndex
from router.control_link.routing import Route

# The routing of a model outside the catalog (deployed by hand): the defaults.
DEFAULT_ROUTING = RoutingPolicy()


class Reason(StrEnum):
    """Why a replica was chosen: metric label and span attribute values."""

    PREFIX = "prefix"  # chosen for the cached prefix it holds
    STICKY = "sticky"  # the sticky key's last replica (same scoring, not a pin)
    RENDEZVOUS = "rendezvous"  # nothing held anywhere: rendezvous hash of the lead
    # Passed over for load: the best-cached replica was past the slack, or a
    # new conversation's hashed replica had more than its share of them.
    BALANCE = "balance"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"
    SESSION = "session"  # policy session: rendezvous on lead/sticky only


@dataclass(frozen=True, slots=True)
class Choice:
    """The candidates in the order to try them, and why the first."""

    order: list[Route]  # candidates, best first (the proxy tries them in order)
    reason: Reason
    predicted: int  # predicted cached tokens on order[0]


def rendezvous(lead: int, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` in highest-random-weight order for ``lead``: the same
    in every process, and removing one replica moves only the keys it had."""
    seed = lead.to_bytes(8, "big")

    def weight(replica_id: str) -> tuple[bytes, str]:
        h = hashlib.blake2b(seed, digest_size=8)
        h.update(replica_id.encode())
        return h.digest(), replica_id

    return sorted(replica_ids, key=weight, reverse=True)


def choose(
    policy: RoutingPolicy,
    candidates: Sequence[Route],
    key: PromptKey | None,
    index: PrefixIndex,
    sticky_replica: str | None,
    turn: int,
    *,
    sticky_tokens: int = 0,
    homes: Mapping[str, int] | None = None,
    placed: str | None = None,
) -> Choice:
    """Order ``candidates`` (healthy, unsaturated, least in flight first)
    for a request; ``sticky_replica`` scores as holding ``sticky_tokens``
    of this prompt (the previous prompt of its sticky key, see Affinity).
    ``homes``: live conversations per replica; ``placed``: where this
    request's conversation lives (None: new to this router)."""
    routes = list(candidates)
    if not routes:
        return Choice([], Reason.LEAST_LOADED, 0)
    kind = policy.policy
    if (
        key is None
        or kind is RoutingPolicyKind.LEAST_LOADED
        or (kind is RoutingPolicyKind.PREFIX and key.prompt_tokens < policy.min_match_tokens)
    ):
        return _choice(routes, routes[0], Reason.LEAST_LOADED, key, index)
    if kind is RoutingPolicyKind.ROUND_ROBIN:
        # A stable order (by id) turned: the candidates arrive already rotated
        # by the table's own counter, and rotating that again by a counter
        # that moves in step skips every other replica.
        stable = sorted(routes, key=lambda r: r.replica_id)
        shift = turn % len(stable)
        rotated = stable[shift:] + stable[:shift]
        return _choice(rotated, rotated[0], Reason.ROUND_ROBIN, key, index)
    least = min(r.inflight for r in routes)
    within = [r for r in routes if r.inflight <= least + policy.balance_slack]
    if kind is RoutingPolicyKind.SESSION:
        return _choice(routes, _hashed(key.lead, within), Reason.SESSION, key, index)
    scores = {r.replica_id: index.match(r.replica_id, key) for r in routes}
    if sticky_replica in scores and sticky_tokens > scores[sticky_replica]:
        scores[sticky_replica] = sticky_tokens
    gain = max(1, policy.min_match_tokens)
    by_id = {r.replica_id: r for r in within}
    # One hash order for the whole choice: rendezvous order restricted to a
    # subset is that subset's own order.
    order = rendezvous(key.lead, list(by_id))
    hashed = by_id[order[0]]
    counts = homes or {}
    # The mean over the candidates and every replica with conversations: one
    # at max_inflight is no candidate for now, and its conversations must not
    # loosen the others' share.
    replicas = len(counts.keys() | {r.replica_id for r in routes})
    # A move recomputes the conversation's own tokens (its head is found
    # anywhere): worth it while they are no more than the head (a chat's
    # early turns), not for a 2,000-token document behind a short system
    # prompt (bench W2 computed more with such moves than without).
    movable = key.prompt_tokens - key.head_tokens <= key.head_tokens
    favourite, moved = _home(
        policy, key.lead, by_id, order, routes, replicas, counts, placed, movable
    )
    best_within = max(scores[r.replica_id] for r in within)
    chosen = favourite
    # The head (system prompt, tools: what precedes the lead) is assumed held
    # by the favourite too: every replica holds it once it served
    # it, and following it would pile new conversations onto whichever replica
    # served it first, differently in each router.
    credited = max(scores[favourite.replica_id], min(best_within, key.head_tokens))
    if best_within - credited >= gain and not moved:
        chosen = by_id[next(r for r in order if scores[r] == best_within)]
    score = scores[chosen.replica_id]
    reason = Reason.PREFIX if score >= gain else Reason.RENDEZVOUS
    if chosen.replica_id == sticky_replica and index.match(chosen.replica_id, key) < score:
        reason = Reason.STICKY
    if max(scores.values()) - score >= gain:
        reason = Reason.BALANCE  # a replica past the slack held significantly more
    elif moved or (chosen is favourite is not hashed and placed is None):
        reason = Reason.BALANCE  # placed off its hash, or moved, for its share
    return Choice(_first(routes, chosen), reason, scores[chosen.replica_id])


def _home(
    policy: RoutingPolicy,
    lead: int,
    within: Mapping[str, Route],
    order: list[str],
    routes: list[Route],
    replicas: int,
    homes: Mapping[str, int],
    placed: str | None,
    movable: bool = True,
) -> tuple[Route, bool]:
    """The conversation's own replica, and whether it leaves its home for
    balance. ``within``: the candidates within the slack, by id, ``order``
    their ids in the lead's hash order.

    A live conversation: where it lives, if within the slack, unless that
    replica has more than ``balance_factor x (the fewest + 1)`` and it is
    ``movable``: then the first within with at least two fewer. A new one:
    the first within under its share counting itself
    (``ceil(balance_factor x (live + 1) / replicas)``), then the first of
    every candidate under it, then the fewest within.

    A new conversation goes past the slack for its share: it stays for all
    its turns, and a replica the moment's load kept out of new conversations
    would end with fewer for good (bench W1: 5/3 where 4/4 was due). Its
    first turn computes its prompt anyway; max_inflight still bounds the
    queue it joins (a saturated replica is no candidate)."""
    live = sum(homes.values())
    if placed is not None and placed in within:
        # Its replica has more than balance_factor x (the fewest + 1) (placed
        # there while the others were saturated, moved there for load, or
        # others' conversations ended): it moves to one with at least two
        # fewer. Its head is found there (every replica holds it, or its
        # slot is primed with it); only its own turns are computed again.
        # Against the fewest, not the mean: 5/4/4/3 is within every mean's
        # ceiling, and 1.67 apart in load.
        here = homes.get(placed, 0)
        fewest = min(homes.get(r.replica_id, 0) for r in routes)
        if movable and policy.balance_factor > 0 and here > policy.balance_factor * (fewest + 1):
            for replica_id in order:
                if homes.get(replica_id, 0) <= here - 2:
                    return within[replica_id], True
        return within[placed], False
    if policy.balance_factor <= 0:
        return within[order[0]], False
    share = math.ceil(policy.balance_factor * (live + 1) / max(1, replicas))
    for replica_id in order:
        if homes.get(replica_id, 0) < share:
            return within[replica_id], False
    if placed is None:
        everyone = {r.replica_id: r for r in routes}
        for replica_id in rendezvous(lead, list(everyone)):
            if homes.get(replica_id, 0) < share:
                return everyone[replica_id], False
    return within[min(order, key=lambda r: homes.get(r, 0))], False


def _hashed(lead: int, routes: list[Route]) -> Route:
    """The route rendezvous hashing of ``lead`` puts first."""
    by_id = {r.replica_id: r for r in routes}
    return by_id[rendezvous(lead, list(by_id))[0]]


def _first(routes: list[Route], chosen: Route) -> list[Route]:
    """``chosen`` then the others in their order (fewest in flight first)."""
    return [chosen, *(r for r in routes if r is not chosen)]


def _choice(
    routes: list[Route], chosen: Route, reason: Reason, key: PromptKey | None, index: PrefixIndex
) -> Choice:
    predicted = index.match(chosen.replica_id, key) if key is not None else 0
    return Choice(_first(routes, chosen), reason, predicted)
