from __future__ import annotations

from monarch.actor import endpoint

from workers.engine.actors.faults import FaultInjectableActor
from workers.engine.actors.procs import set_proc_threads
from workers.engine.config import OverlongConfig
from workers.engine.models.tokenizer import ChatTokenizer
from workers.engine.scoring import score_rollouts
from workers.engine.replay_buffer import RolloutBatchRecord
from workers.engine.rewards import CombinedReward
from workers.engine.sampler import Completion
from workers.engine.tasks import Problem


class RewardActor(FaultInjectableActor):
    """Decodes completions, scores them, and normalises advantages per group (divided by the group's std unless
    `std_normalised` is False: Dr. GRPO), with DAPO's soft overlong punishment when `overlong.penalty_tokens` is set."""

    def __init__(self, model_folder: str, functions: list[str], weights: list[float] | None, std_normalised: bool,
                 overlong: OverlongConfig, max_new_tokens: int):
        set_proc_threads()
        tokenizer = self.unless_refused(ChatTokenizer, model_folder)
        if tokenizer is None:  # model.path's error: `pid` raises it
            return
        self.tokenizer = tokenizer
        self.reward = CombinedReward(functions, weights)
        self.std_normalised = std_normalised
        self.overlong, self.max_new_tokens = overlong, max_new_tokens

    @endpoint
    def score(self, problems: list[Problem], prompts: list[list[int]], completions: list[Completion],
              group_size: int) -> RolloutBatchRecord:
        self.before_work(problems, prompts, completions)
        return score_rollouts(problems, prompts, completions, self.reward, self.tokenizer, group_size=group_size,
                              std_normalised=self.std_normalised, overlong=self.overlong,
                              max_new_tokens=self.max_new_tokens)
