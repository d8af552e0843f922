#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, started for the test and stopped after it: munged,
# slurmctld and slurmd with a generated slurm.conf in a temporary directory (nothing under /etc is
# touched). It runs an allreduce job with `srun -n 2` and the shipped examples/slurm/train.sbatch
# with `sbatch --wait`, and checks both trained to the end. When the cluster cannot be started the
# test FAILS, naming why and showing the daemons' logs: it never skips.
# Usage: slurm_cluster.sh COHORT_BINARY SOURCE_DIR
set -euo pipefail
cohort=$1
source=$2
work=$(mktemp -d /tmp/cohort-slurm-XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2> /dev/null || true; done
  # A step daemon of this cluster that outlived slurmd (seen once under load, after PASS) kept the
  # test from ending until ctest's timeout: it is this cluster's when its SLURM_CONF is ours.
  for pid in $(pgrep -x slurmstepd || true); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null | grep -qx "SLURM_CONF=$work/slurm.conf"; then
      kill -9 "$pid" 2> /dev/null || true
    fi
  done
  rm -rf "$work"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  for log in "$work"/*.log; do
    [ -f "$log" ] && { echo "--- $log" >&2; tail -n 30 "$log" >&2; }
  done
  exit 1
}

for tool in munged slurmctld slurmd srun sbatch sinfo scontrol; do
  command -v "$tool" > /dev/null || fail "$tool is not installed (bash scripts/setup.sh installs slurm-wlm and munge)"
done

# Ports for slurmctld, slurmd and the srun job's rendezvous, which must be written down before their
# listeners start: a helper binds each (SO_REUSEADDR, never listening) and holds it until the test
# ends, so that nothing else can take one before its listener (which sets SO_REUSEADDR too) binds it.
coproc reserve {
  exec python3 -u -c '
import socket, sys
held = []
for _ in range(3):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    held.append(s)
print(" ".join(str(s.getsockname()[1]) for s in held))
sys.stdin.read()'
}
pids+=("$reserve_PID")
read -r ctld_port slurmd_port master_port <&"${reserve[0]}" || fail "could not reserve ports"

# munge: its own key, socket and state in the work directory.
mkdir -p "$work/munge" "$work/state" "$work/spool"
chmod 700 "$work/munge"
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$work/munge/munge.key"
munged --force --socket="$work/munge/munge.sock" --key-file="$work/munge/munge.key" \
  --pid-file="$work/munge/munged.pid" --log-file="$work/munged.log" --seed-file="$work/munge/munge.seed" \
  || fail "munged did not start"
pids+=("$(cat "$work/munge/munged.pid")")

node=$(hostname -s)
getent hosts "$node" > /dev/null || fail "this machine's name '$node' does not resolve: Slurm's node list names it"
cpus=$(nproc)
cat > "$work/slurm.conf" << CONF
ClusterName=cohorttest
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
AuthInfo=socket=$work/munge/munge.sock
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$work/slurm.conf"

slurmctld -D -i > "$work/slurmctld.out.log" 2>&1 &
pids+=($!)
slurmd -D > "$work/slurmd.out.log" 2>&1 &
pids+=($!)

# The node is up once sinfo says idle (bounded: 60 s). A poll of the daemons' state, not a sleep as
# synchronization: slurmctld offers no event to wait on, the loop goes on only when sinfo says idle,
# and a daemon that exits meanwhile ends it at once.
for _ in $(seq 120); do
  state=$(sinfo -h -N -o %T 2> /dev/null | head -n 1 || true)
  [ "$state" = "idle" ] && break
  for pid in "${pids[@]}"; do kill -0 "$pid" 2> /dev/null || fail "a Slurm daemon exited while starting"; done
  sleep 0.5
done
[ "$state" = "idle" ] || fail "the node did not come up (state '${state:-none}')"

export OMP_NUM_THREADS=1
# 1. srun: two tasks of an allreduce job.
MASTER_PORT=$master_port timeout -k 5 120 srun -n 2 --time=5 "$cohort" train --strategy allreduce --model mlp \
  --data synthetic:2000 --steps 20 --progress off --timeout 60 > "$work/srun.out.log" 2>&1 \
  || fail "srun -n 2 cohort train failed"
grep -q "^done: 20 steps" "$work/srun.out.log" || fail "srun: no 'done: 20 steps' from rank 0"
echo "srun -n 2: $(grep '^done:' "$work/srun.out.log")"

# 2. sbatch: the shipped script, waited for.
cd "$work"
COHORT="$cohort" DATA=synthetic:2000 CHECKPOINTS="$work/ckpt" timeout -k 5 180 \
  sbatch --wait --output="$work/sbatch.out.log" "$source/examples/slurm/train.sbatch" --steps 20 \
  > "$work/sbatch.submit.log" 2>&1 || fail "sbatch --wait examples/slurm/train.sbatch failed"
grep -q "^done: 20 steps" "$work/sbatch.out.log" || fail "sbatch: no 'done: 20 steps' in the job's output"
ls "$work/ckpt"/ckpt-*.ckpt > /dev/null 2>&1 || fail "sbatch: the job wrote no checkpoint"
echo "sbatch: $(grep '^done:' "$work/sbatch.out.log")"
echo "PASS"
