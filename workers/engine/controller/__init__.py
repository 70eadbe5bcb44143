"""The Monarch GRPO controller's parts, each a small class over named state (`recipes/grpo_monarch.py` puts them
together and runs the step loop):

  state.py          RunState: step, policy version, generations in flight, what a checkpoint saves, fault totals
  placement.py      Placer: where a role, a replacement, a spare or a drained host's replicas go (no Monarch)
  waits.py          Waits: every wait polls, times out, and ticks supervision while it waits
  incidents.py      how a trainer or control failure is noticed once and its recovery recorded
  trainer.py        TrainerHandle: the trainer's mesh (start, step, save, load, its failures)
  control_procs.py  ControlProcs: the dataset and replay buffer's proc (start, calls, replacement)
  supervision.py    Supervisor: failure reports, lost hosts, dead procs, replacements and warm spares
  requests.py       Router: a call routed to a replica, retried elsewhere when the replica fails
  drill_targets.py  DrillTargets: which process, host and replica a drill hits, and when
  operator.py       Operator: placement changes and load redirects an operator asks for
  generation.py     GenerationPipeline: weight sync, launching and scoring generations (sync, async, pipelined)
  recovery.py       Recovery: back to the last checkpoint after a trainer or control failure
"""
