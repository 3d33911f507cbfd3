# Sourced by .ci/run: can this machine run the Slurm tests of tests/slurm (a real Slurm on loopback)?
SLURM_SBIN=${SLURM_SBIN:-/usr/sbin}

# 0 when Slurm's daemons, its client commands and munge are there and we are root: the tests then run.
slurm_tests_can_run() {
    [ "$(id -u)" = 0 ] || return 1
    for tool in slurmctld slurmd munged; do
        command -v "$tool" >/dev/null 2>&1 || [ -x "$SLURM_SBIN/$tool" ] || return 1
    done
    for tool in sbatch squeue scancel sinfo scontrol; do
        command -v "$tool" >/dev/null 2>&1 || return 1
    done
}

# As root with apt-get, install Debian's Slurm and munge when missing; otherwise say why the tests will skip.
ensure_slurm() {
    slurm_tests_can_run && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge; } \
            || echo "warning: could not install Slurm; the tests of tests/slurm will skip" >&2
    else
        echo "note: no Slurm (apt-get install slurmctld slurmd slurm-client munge as root); tests/slurm will skip" >&2
    fi
}
