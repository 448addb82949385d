#!/bin/bash
# examples/mlp.py under torchrun, with gossiprec as the rendezvous backend: no etcd, no c10d store host,
# and a killed worker replaced in place by a hot spare while the other ranks keep their processes.
#
# On a cluster, run the same command on every host (one torchrun per host, one worker each); the hosts
# list gives every slot, the last `spares` of them are hot spares, and each torchrun finds its own slot
# from its host name (or from --rdzv-conf name=... / GOSSIPREC_NODE):
#
#   export GOSSIPREC_KEYRING=/shared/keyring.json        # one key for the job, a 0600 file
#   torchrun --nnodes 5 --nproc-per-node 1 --max-restarts 0 \
#            --rdzv-backend gossiprec --rdzv-conf 'hosts=gpu[01-05],spares=1' \
#            examples/mlp.py --steps 1000
#
# --nnodes counts the spares too (every slot is a torchrun node); --nproc-per-node 1 and --max-restarts 0
# are required: torchrun stops every worker of a node when one fails and restarts them all, which is
# the restart gossiprec avoids. Write ';' for a comma inside a host list (torchrun splits --rdzv-conf at
# commas), and spec=job.toml instead of hosts= to use a job spec written by `gossiprec spec`.
#
# `gossiprec torchrun ARGS` is torchrun with the backend registered in-process (and --rdzv-backend
# gossiprec added): use it where the package's torchrun.handlers entry point is not installed; with the
# entry point, plain `torchrun --rdzv-backend gossiprec` is the same. TORCHRUN picks one for this script.
#
# This script plays the cluster on one machine: three "hosts" n1..n3 on 127.0.0.1 (2 trainers and a
# spare), and KILL_AFTER seconds into training (0: never) it SIGKILLs the worker of n2: the spare n3 takes rank 1
# with n1's state and training goes on from the last committed step. Logs: $WORK/n*.log.
#
#   bash examples/torchrun_mlp.sh            # STEPS=1500 KILL_AFTER=10 BASE_PORT=29400 TORCHRUN="gossiprec torchrun"
set -eu

steps=${STEPS:-1500}
kill_after=${KILL_AFTER:-10}
base_port=${BASE_PORT:-29400}
read -r -a torchrun <<<"${TORCHRUN:-gossiprec torchrun}"
WORK=${WORK:-$(mktemp -d -t gossiprec-torchrun-XXXXXX)}
here=$(cd "$(dirname "$0")" && pwd)

gossiprec keys install "$(gossiprec keys generate)" --keyring "$WORK/keyring.json" >/dev/null
export GOSSIPREC_KEYRING=$WORK/keyring.json OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
conf="hosts=n[1-3],spares=1,addr=n1=127.0.0.1;n2=127.0.0.1;n3=127.0.0.1,base_port=$base_port"

pids=()
for i in 1 2 3; do
  "${torchrun[@]}" --nnodes 3 --nproc-per-node 1 --max-restarts 0 --rdzv-backend gossiprec \
           --rdzv-conf "$conf,host=n$i" "$here/mlp.py" --steps "$steps" >"$WORK/n$i.log" 2>&1 &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
echo "torchrun n1 n2 n3: pids ${pids[*]}; logs in $WORK"

if [ "$kill_after" -gt 0 ]; then
  # KILL_AFTER counts from the first step rank 0 prints (torch's import and the rendezvous come first)
  until grep -q "^step " "$WORK/n1.log" 2>/dev/null || ! kill -0 "${pids[0]}" 2>/dev/null; do sleep 0.5; done
  sleep "$kill_after"
  worker=$(pgrep -P "${pids[1]}" | head -n 1 || true)  # torchrun's one child is its worker
  if [ -n "$worker" ]; then
    echo "SIGKILL the worker of n2 (pid $worker): the spare n3 takes its rank"
    kill -9 "$worker"
  else
    echo "n2 has no worker to kill (the job ended first?): raise STEPS or lower KILL_AFTER"
  fi
fi

status=0
for i in 0 1 2; do
  if wait "${pids[$i]}"; then echo "torchrun n$((i + 1)): done"; else echo "torchrun n$((i + 1)): exit $?"; status=1; fi
done
# n2's torchrun fails (its worker was killed); n1 and n3 finish the job together
grep -h "step\|finished\|no longer needed" "$WORK"/n1.log "$WORK"/n3.log | tail -n 4
exit $status
