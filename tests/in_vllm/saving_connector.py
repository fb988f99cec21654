"""A store connector in the shape of vLLM's asynchronous savers (MooncakeStoreConnector,
LMCache, the offloading connector), for the preemption scenario: after each step's forward pass
the worker queues a save of the blocks that step computed, and a background thread reads them
later. The scheduler side keeps the books a store connector keeps: which blocks each request's
queued saves will read (``saving``), until the worker says they are done (``finished_sending``
for a request that ended, whose free it delays meanwhile; ``saved`` for a running one).

It learns of a preemption the way vLLM tells a connector: ``preempted_req_ids`` in the
``SchedulerOutput`` passed to ``build_connector_meta``, built after the step's scheduling, in
which the preempted request's blocks were already freed and possibly handed to another request.
"""

from __future__ import annotations

from typing import Any

from inert_connector import InertConnector, Meta


class SavingConnector(InertConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.blocks: dict[str, list[int]] = {}  # request -> its blocks, as vLLM reported them
        self.saving: dict[str, set[int]] = {}  # request -> blocks its queued saves will read
        self.preempted_while_saving: dict[str, set[int]] = {}  # learnt at build_connector_meta

    # scheduler side
    def build_connector_meta(self, scheduler_output: Any) -> Meta:
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self.saving:
                self.preempted_while_saving[req_id] = set(self.saving[req_id])
            self.blocks.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        # (vLLM 0.34 has no resumed_req_ids: a resumed request arrives in scheduled_new_reqs)
        resumed = getattr(cached, "resumed_req_ids", ())
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_ids is not None:
                if req_id in resumed:  # a preempted request resumed: new blocks
                    self.blocks[req_id] = list(new_ids[0])
                else:
                    self.blocks.setdefault(req_id, []).extend(new_ids[0])
        # The worker queues a save of what this step computes: every scheduled request's blocks.
        for req_id in scheduler_output.num_scheduled_tokens:
            self.saving.setdefault(req_id, set()).update(self.blocks.get(req_id, ()))
        return Meta()

    def saved(self, request: str) -> None:
        """The worker says the request's queued saves have read their blocks."""
        self.saving.pop(request, None)

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_sending or ():
            self.saving.pop(req_id, None)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        # A save still reading the blocks: vLLM keeps them until finished_sending.
        return request.request_id in self.saving, None

    # worker side: InertConnector's (not driven: the scenario runs the scheduler only)
