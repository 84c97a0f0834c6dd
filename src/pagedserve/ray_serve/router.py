"""Prefix-aware routing on Ray Serve's request-router API: a request goes to the replica that
was last sent the longest leading part of its prompt (its KV pages are likely still cached
there), unless the replicas' loads differ by more than a threshold, when the least loaded wins.
A prompt no replica has seen goes to the least loaded, then the one remembering the fewest
prefixes, so new prefixes spread evenly.

The router runs in the front door's process (one per handle), so its memory covers every
request the application routes."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.ray_serve.prefix_index import PrefixIndex, block_hashes
from pagedserve.ray_serve.relay import RelayedRequest

# Requests in flight by which the busiest replica may lead the idlest before affinity yields:
# small, since on a replica of a core or two a few extra sequences already slow every step.
DEFAULT_IMBALANCED_THRESHOLD = 4


def _routing_key(pending: PendingRequest | None) -> str:
    if pending is None or not pending.args or not isinstance(pending.args[0], RelayedRequest):
        return ""
    return pending.args[0].routing_key


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalanced_threshold: int = DEFAULT_IMBALANCED_THRESHOLD) -> None:
        self._imbalanced_threshold = imbalanced_threshold
        self._index = PrefixIndex()

    def _load(self, replica: RunningReplica) -> int:
        # The base router's cache of each replica's ongoing requests (probed, and counted up on
        # every send); unknown counts as idle, and the base probes before sending anyway.
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every candidate is ranked below: a full round is a reason to back off.
            pending_request.routing_context.should_backoff = True
        loads = {r.replica_id.unique_id: self._load(r) for r in candidate_replicas}
        by_load = sorted(
            candidate_replicas,
            key=lambda r: (loads[r.replica_id.unique_id], self._index.held(r.replica_id.unique_id)),
        )
        hashes = block_hashes(_routing_key(pending_request))
        if not hashes or not loads:
            return [[r] for r in by_load]
        if max(loads.values()) - min(loads.values()) > self._imbalanced_threshold:
            return [[r] for r in by_load]
        matched = self._index.matched_blocks(hashes, loads)
        best = max(matched.values())
        if best == 0:
            # Claim the new prefix for the replica ranked first at once: requests routed in the
            # same instant (a burst) then see it, and the next new prefix goes elsewhere.
            self._index.insert(hashes, by_load[0].replica_id.unique_id)
            return [[r] for r in by_load]
        first = [r for r in by_load if matched[r.replica_id.unique_id] == best][:1]
        return [first, [r for r in by_load if r not in first]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        hashes = block_hashes(_routing_key(pending_request))
        if hashes:
            self._index.insert(hashes, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id.unique_id)
