#!/usr/bin/env bash
# Try `erm launch` on one machine: an OpenSSH server of your own on a spare loopback port (its own host
# and login keys, your user only), an etcd, and a hostfile in the alias form that puts two nodes on this
# machine behind that server. `erm launch` then starts both nodes over ssh, as it would on a cluster.
#
#   examples/ssh_one_machine.sh            # runs until the job ends; Ctrl-C stops everything it started
#   examples/ssh_one_machine.sh --nodes 3  # three nodes (all on this machine)
#
# Needs sshd, ssh and ssh-keygen (Debian/Ubuntu: apt-get install openssh-server openssh-client) and this
# checkout's virtualenv (.venv, or set PYTHON). Everything goes into a temporary directory that is removed
# at the end; sshd and etcd are stopped by their pids, however the script ends.
set -euo pipefail

NODES=2
STEPS=200
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "ssh_one_machine.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$NODES" in ''|*[!0-9]*|0) echo "ssh_one_machine.sh: --nodes must be a positive number" >&2; exit 2 ;; esac

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
ERM=$(dirname "$PYTHON")/erm
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
for tool in "$SSHD" ssh ssh-keygen "$PYTHON" "$ERM"; do
    command -v "$tool" >/dev/null 2>&1 || {
        echo "ssh_one_machine.sh: $tool not found (OpenSSH: apt-get install openssh-server openssh-client)" >&2
        exit 2
    }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/erm-ssh-XXXXXX")
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for_port() {  # PORT WHAT: up to 20 s
    for _ in $(seq 200); do
        if "$PYTHON" -c "import socket, sys; socket.create_connection(('127.0.0.1', $1), timeout=1)" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    echo "ssh_one_machine.sh: $2 did not listen on 127.0.0.1:$1 within 20 s" >&2
    exit 1
}

# 1. sshd: host key and login key of its own; only the login key is authorized
ssh-keygen -q -t ed25519 -N "" -C erm-ssh-host -f "$WORK/host_ed25519"
ssh-keygen -q -t ed25519 -N "" -C erm-ssh-login -f "$WORK/id_ed25519"
cp "$WORK/id_ed25519.pub" "$WORK/authorized_keys"
SSH_PORT=$(free_port)
cat > "$WORK/sshd_config" <<EOF
Port $SSH_PORT
ListenAddress 127.0.0.1
HostKey $WORK/host_ed25519
AuthorizedKeysFile $WORK/authorized_keys
AllowUsers $(id -un)
PidFile none
UsePAM no
StrictModes no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
LogLevel ERROR
EOF
[ "$(id -u)" = 0 ] && mkdir -p /run/sshd  # sshd's privilege separation directory
"$SSHD" -D -e -f "$WORK/sshd_config" 2>"$WORK/sshd.log" &
PIDS+=($!)
wait_for_port "$SSH_PORT" sshd

# 2. etcd for the rendezvous (one member, loopback)
ETCD_PORT=$(free_port)
"$ERM" etcd --name one --data-dir "$WORK/etcd" --listen-host 127.0.0.1 --advertise-host 127.0.0.1 \
    --client-port "$ETCD_PORT" --peer-port "$(free_port)" >"$WORK/etcd.log" 2>&1 &
PIDS+=($!)
wait_for_port "$ETCD_PORT" etcd

# 3. the hostfile, alias form: NAME addr=HOST port=SSH_PORT, several nodes behind one address
for i in $(seq "$NODES"); do
    echo "n$i addr=127.0.0.1 port=$SSH_PORT"
done > "$WORK/hosts"
echo "hostfile $WORK/hosts:"
sed 's/^/  /' "$WORK/hosts"

# 4. the job: the emulated workload (its steps sleep), over ssh to this machine
RUN=ssh-demo-$$
echo "erm launch: run $RUN, $NODES node(s) over ssh to 127.0.0.1:$SSH_PORT; follow it with"
echo "  $ERM events --endpoint 127.0.0.1:$ETCD_PORT --run-id $RUN --follow"
cd "$REPO"
"$ERM" launch --hostfile "$WORK/hosts" --python "$PYTHON" --workdir "$REPO" \
    --ssh-identity "$WORK/id_ed25519" --ssh-option StrictHostKeyChecking=no \
    --ssh-option UserKnownHostsFile=/dev/null --ssh-option LogLevel=ERROR \
    --nnodes "1:$NODES" --nproc-per-node 1 --rdzv-endpoint "127.0.0.1:$ETCD_PORT" --rdzv-id "$RUN" \
    examples/emulated/train.py --samples $((STEPS * 64)) --global-batch 64 --step-s 0.05 --state "$WORK/state"
