"""Tell the agent what a restore did: the global step (so that the reporter, ``on_stop`` and the drain
count the job's steps, not this process's), the world that saved and the world that loaded, and where
each file came from. The agent turns the reports of its workers into one "restore" event with the
downtime and the steps trained again (:mod:`elastic_rm.agent.restores`)."""

from __future__ import annotations

from ..wire.channel import ENV_ROUND, KIND_RESTORED
from ..wire.restore import encode_restored
from .report import StepReporter, when_ready
from .restore import RestoreResult
from .worker_env import env_int


def report_restore(result: RestoreResult, world_after: int) -> None:
    """Set the reporter's global step to the restored one; its agent hears the report after the next step
    (now, or when the script makes its reporter after restoring). A process that trained before the restore
    (a round in place) says its newest step: that step, not the agent's last report, starts the downtime."""

    def tell(reporter: StepReporter) -> None:
        body = encode_restored(
            max(0, env_int(ENV_ROUND)),
            result.step,
            int(result.manifest.get("world_size", world_after)),
            world_after,
            result.file_sources,
            result.load_s,
            step_before=reporter.newest_step(),
        )
        reporter.set_step(result.step)
        reporter.send_after_next_step(KIND_RESTORED, body)

    when_ready(tell)
