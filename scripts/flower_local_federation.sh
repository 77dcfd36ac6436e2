#!/usr/bin/env bash
# A loopback Flower deployment of fedlore: 1 SuperLink + N SuperNodes on 127.0.0.1, then
# `flwr run .` of fedlore's ServerApp/ClientApp; every process started here is stopped by PID.
#
#   scripts/flower_local_federation.sh [N] [key=value ...]
#   N=3 METHOD=fedlore CONFIG=experiments/quickstart.yaml scripts/flower_local_federation.sh 3 rounds=2
#   scripts/flower_local_federation.sh 3 rounds=3 --overwrite   # replace a finished run of another config
#   SEED=43 ... --resume                                         # continue a killed run
#
# Results go to runs/flower_local/<method>/seed-<seed>/ (its own run name, so the main job's
# runs/quickstart/ is never touched); give name=... or output_dir=... to put them elsewhere.
# The folder is printed at the end.
#
# Site-local data: SITES="site0/ site1/ site2/" gives SuperNode i its own data-root (read with
# the config's data.name, e.g. data.name=npz with train.npz per site) and sets
# flower.site_data=true; the server then reads only the test split of data.root:
#   SITES="s0 s1 s2" scripts/flower_local_federation.sh 3 data.name=npz data.root=server/
#
# Client states on the nodes' disks: NODE_STATES=<folder> gives SuperNode i the node config
# state-dir="<folder>/node-<i>" and sets flower.node_states=true, so that --resume of a killed
# run keeps every client's state (docs/how-to/resume.md); give the same folder to the resume.
#
# TLS and node authentication: start flower-superlink with --ssl-ca-certfile/--ssl-certfile/
# --ssl-keyfile (and --enable-supernode-auth --auth-list-public-keys), the SuperNodes with
# --root-certificates (and --auth-supernode-private-key/--auth-supernode-public-key), and set
# root-certificates instead of insecure in the connection below (Flower's deployment docs).
set -euo pipefail
CALLER=$PWD   # relative paths the user gives (SITES, output_dir=) are relative to here
cd "$(dirname "$0")/.."
N=${1:-3}; shift || true
SEED=${SEED:-42}
METHOD=${METHOD:-fedlore}
CONFIG=$(realpath "${CONFIG:-experiments/quickstart.yaml}")
NAME=flower_local; OUT_DIR=$(pwd)/runs; RESUME=false; OVERWRITE=false
ARGS=()
for kv in "$@"; do   # the user's name= / output_dir= win; defaults keep the main job's runs apart
  case $kv in
    --resume) RESUME=true; continue ;;
    --overwrite) OVERWRITE=true; continue ;;
    name=*) NAME=${kv#name=} ;;
    output_dir=*) OUT_DIR=$(cd "$CALLER" && realpath -m "${kv#output_dir=}"); kv="output_dir=$OUT_DIR" ;;
    data.root=*) kv="data.root=$(cd "$CALLER" && realpath -m "${kv#data.root=}")" ;;
  esac
  ARGS+=("$kv")
done
set -- "${ARGS[@]+"${ARGS[@]}"}"
read -r -a SITE_DIRS <<< "${SITES:-}"
SITE_FLAG=""
if [ ${#SITE_DIRS[@]} -gt 0 ]; then
  [ ${#SITE_DIRS[@]} -eq "$N" ] || { echo "SITES names ${#SITE_DIRS[@]} folders for $N SuperNodes" >&2; exit 2; }
  SITE_FLAG="flower.site_data=true"
fi
STATES_FLAG=""
if [ -n "${NODE_STATES:-}" ]; then
  NODE_STATES=$(cd "$CALLER" && realpath -m "$NODE_STATES")
  STATES_FLAG="flower.node_states=true"
fi
OVERRIDES="num_clients=$N progress=false name=$NAME output_dir=$OUT_DIR $SITE_FLAG $STATES_FLAG $*"
BIN=$(realpath "${BIN:-.venv/bin}")
export PATH="$BIN:$PATH"   # the SuperLink and SuperNodes spawn flower-superexec, flwr-serverapp, flwr-clientapp
BASE_PORT=${BASE_PORT:-19090}
WORK=$(mktemp -d /tmp/fedlore-flower.XXXXXX)

export FLWR_HOME="$WORK/flwr" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 \
  FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
# every SuperExec asks for a new task (a ServerApp or ClientApp process to start) every 0.2 s,
# not Flower's 1 s: a round waits less between a message's arrival and its ClientApp's start
export FLWR_SUPEREXEC_TASK_POLL_INTERVAL=${FLWR_SUPEREXEC_TASK_POLL_INTERVAL:-0.2}
mkdir -p "$FLWR_HOME"

PIDS=()
KEEP_WORK=1   # the SuperLink's state and the logs stay for a run that did not finish
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ "$KEEP_WORK" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

LINK=127.0.0.1:$BASE_PORT   # Flower 1.42 serves Fleet, Control and ServerAppIo on one HTTP API
"$BIN/flower-superlink" --insecure --database "$WORK/state.db" \
  --disable-runtime-dependency-installation --host 127.0.0.1 --port "$BASE_PORT" \
  > "$WORK/superlink.log" 2>&1 &
PIDS+=($!)
echo "SuperLink pid $! (logs in $WORK, removed once the run has finished)"
# wait until it accepts connections (a fixed sleep was too short on a loaded machine: flwr run
# then failed on the connection)
for _ in $(seq 1200); do
  (exec 3<>"/dev/tcp/127.0.0.1/$BASE_PORT") 2>/dev/null && break
  kill -0 "${PIDS[0]}" 2>/dev/null || { echo "fedlore: the SuperLink exited; see $WORK/superlink.log" >&2; exit 1; }
  sleep 0.1
done
(exec 3<>"/dev/tcp/127.0.0.1/$BASE_PORT") 2>/dev/null || { echo "fedlore: the SuperLink did not open port $BASE_PORT in 120 s; see $WORK/superlink.log" >&2; exit 1; }
for i in $(seq 0 $((N - 1))); do
  NODE_CONFIG="partition-id=$i num-partitions=$N"
  if [ -n "$SITE_FLAG" ]; then
    SITE=$(cd "$CALLER" && realpath -e "${SITE_DIRS[$i]}") || { echo "SITES: ${SITE_DIRS[$i]} not found (relative to $CALLER)" >&2; exit 2; }
    NODE_CONFIG="$NODE_CONFIG data-root=\"$SITE\""
  fi
  if [ -n "$STATES_FLAG" ]; then
    NODE_CONFIG="$NODE_CONFIG state-dir=\"$NODE_STATES/node-$i\""
  fi
  "$BIN/flower-supernode" --insecure --superlink "$LINK" \
    --host 127.0.0.1 --port $((BASE_PORT + 10 + i)) \
    --node-config "$NODE_CONFIG" > "$WORK/supernode-$i.log" 2>&1 &
  PIDS+=($!)
  echo "SuperNode $i pid $!"
done
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "fedlore-local"

[superlink.fedlore-local]
address = "$LINK"
insecure = true
TOML
sleep 3
touch "$WORK/started"
# a failing `flwr run` (the SuperLink lost mid-run) must still reach the check below, which
# says where the logs are: without `|| ...`, set -e would end the script on Flower's own error
FLWR_STATUS=0
"$BIN/flwr" run . fedlore-local --stream \
  --run-config "config='$CONFIG' method='$METHOD' seed=$SEED resume=$RESUME overwrite=$OVERWRITE overrides='$OVERRIDES'" \
  || FLWR_STATUS=$?
SUMMARY="$OUT_DIR/$NAME/$METHOD/seed-$SEED/summary.json"
if [ -f "$SUMMARY" ] && { [ "$SUMMARY" -nt "$WORK/started" ] || [ "$RESUME" = true ]; }; then
  echo "results in $OUT_DIR/$NAME/$METHOD/ (fedlore report $OUT_DIR/$NAME)"
  KEEP_WORK=0
else
  WHY="its error is above"
  [ "$FLWR_STATUS" = 0 ] || WHY="flwr run exited with status $FLWR_STATUS; its error is above"
  echo "fedlore: the deployed run did not finish ($WHY; logs in $WORK)" >&2
  exit 1
fi
