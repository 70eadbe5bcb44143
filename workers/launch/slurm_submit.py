"""Applies a run's `monarch.job.SlurmJob` (batch mode) in a process of its own (`main`, run by the SLURM backend).

Run by `slurm_backend.submit_slurm` with the run's folder as working directory (SlurmJob pickles the
job into `.monarch/job_state.pkl` there, and sbatch makes it the job's working directory) and with just
the environment the job should have (sbatch exports the submitter's environment to the job): a
process of its own keeps the worker's working directory, environment and secrets out of the job, and
lets the caller bound how long `sbatch` may take. Reads the request as JSON on stdin; prints
{"job_id": ...} or {"error": ...} (exit 3) on stdout.
"""

from __future__ import annotations

import json
import sys

from workers.launch.slurm import SlurmLaunchRequest, client_script, slurm_job

EXIT_REFUSED = 3


def main() -> int:
    try:
        request = SlurmLaunchRequest.from_json(json.load(sys.stdin))
        job = slurm_job(request)
        job.apply(client_script=client_script(request))
    except (RuntimeError, OSError, TypeError, ValueError) as exc:  # LaunchSpecError is a ValueError
        print(json.dumps({"error": str(exc).strip()}))
        return EXIT_REFUSED
    # monarch 0.7 keeps the SLURM job id it parsed from sbatch's answer only here (apply_id is its own uuid).
    print(json.dumps({"job_id": job._slurm_job_id}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
