"""A stand-in for ``torch.distributed.pipelining.PipelineStage``: just what torch's schedule constructors read of
a stage (and what a runtime schedule reads while loading a CSV), so that a test can build a schedule's real order
with no process group. Nothing here runs a pipeline."""

from __future__ import annotations


class StandInStage:
    """Model stage ``index`` of ``stages``, on ``rank`` of ``ranks`` pipeline ranks."""

    def __init__(self, index: int, stages: int, ranks: int, rank: int) -> None:
        import torch

        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, rank
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = torch.nn.Linear(1, 1)
        self.stage_index_to_group_rank: dict[int, int] = {}
