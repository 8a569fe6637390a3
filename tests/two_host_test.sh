#!/usr/bin/env bash
# Two hosts on one machine: a second network namespace joined to this one by a veth pair, with its
# own address. In it run (1) a blockflow-worker that joins a session of this namespace over TCP and
# (2) the Python client example, submitting to the `serve` example over TCP. Both over CURVE, with
# keys from `blockflowctl keygen`: an impostor worker (another key, same name) is refused and
# counted, and the tensors' bytes appear nowhere in what crossed the veth (captured with an
# AF_PACKET socket by wire_capture.py, whose own check first sees the same bytes sent in clear).
# Exits 77 (ctest: skipped) with a message where namespaces cannot be made.
#
#   two_host_test.sh BLOCKFLOW_TESTS WORKER PLUGIN BLOCKFLOWCTL PYTHON [SERVE PYTHON_CLIENT]
set -euo pipefail

tests=$1 worker=$2 plugin=$3 ctl=$4 python=$5 serve=${6:-} client=${7:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The session's configuration (the tests binary) names this plugin; the joining worker loads it only
# because its own command line allows it (--plugin).

skip() {
  echo "SKIP: two-host test: $*"
  exit 77
}
[ "$(id -u)" -eq 0 ] || skip "creating a network namespace needs root"
command -v ip >/dev/null || skip "iproute2's ip is not installed"

tag=$(( $$ % 100000 ))
ns="bf2h$tag" veth_host="bf2h$tag-a" veth_peer="bf2h$tag-b"
subnet="10.231.$(( $$ % 250 ))"
host_ip="$subnet.1" peer_ip="$subnet.2"
children=()
keys=$(mktemp -d /tmp/bf-two-host-keys.XXXXXX)
cleanup() {
  for pid in "${children[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  ip netns del "$ns" 2>/dev/null || true
  ip link del "$veth_host" 2>/dev/null || true
  rm -rf "$keys"
}
trap cleanup EXIT

ip netns add "$ns" 2>/dev/null || skip "ip netns add failed (no CAP_SYS_ADMIN in this container?)"
ip link add "$veth_host" type veth peer name "$veth_peer" 2>/dev/null || skip "cannot create a veth pair"
ip link set "$veth_peer" netns "$ns"
ip addr add "$host_ip/24" dev "$veth_host"
ip link set "$veth_host" up
ip netns exec "$ns" ip addr add "$peer_ip/24" dev "$veth_peer"
ip netns exec "$ns" ip link set "$veth_peer" up
ip netns exec "$ns" ip link set lo up
# The other host does not share our loopback: only the veth address reaches us.
echo "two-host: namespace $ns at $peer_ip, this host at $host_ip"

# Keys: the session's and the client endpoint's (session), the worker's (far), an impostor's
# (admitted under its own name, so the session knows it, but it is not far's), a client's (alice).
mkdir -p "$keys/authorized" "$keys/clients"
for name in session far impostor alice; do "$ctl" keygen "$name" --dir "$keys" >/dev/null; done
cp "$keys/far.key" "$keys/impostor.key" "$keys/authorized/"
cp "$keys/alice.key" "$keys/clients/"

# The capture: every frame on the namespace's end of the veth, into a file, until stopped.
capture() {  # FILE: starts the capture, waits until it runs; sets capture_pid
  coproc CAPTURE { exec ip netns exec "$ns" "$python" "$here/wire_capture.py" capture "$veth_peer" "$1"; }
  capture_pid=$CAPTURE_PID
  children+=("$capture_pid")
  read -r -t 30 line <&"${CAPTURE[0]}" && [ "$line" = capturing ] || { echo "FAIL: wire_capture did not start"; exit 1; }
}
stop_capture() { kill -TERM "$capture_pid"; wait "$capture_pid" || true; }
marker=00509a44  # float32 1234.5, little-endian: the C++ case sends 64 KiB of it each way
clear_port=$(( 20000 + $$ % 20000 + 2 ))

# The capture's own check: the marker sent in clear from the namespace must be found.
capture "$keys/clear.cap"
"$python" -c "
import socket, sys
s = socket.create_server(('$host_ip', $clear_port)); c, _ = s.accept()
while c.recv(65536): pass" &
sink_pid=$!
children+=("$sink_pid")
# Connects once the sink listens (retried for up to 30 s: it may not have bound yet).
ip netns exec "$ns" "$python" -c "
import socket, time
deadline = time.monotonic() + 30
while True:
    try:
        c = socket.create_connection(('$host_ip', $clear_port)); break
    except ConnectionRefusedError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
c.sendall(bytes.fromhex('$marker') * 4096); c.close()"
wait "$sink_pid"
stop_capture
"$python" "$here/wire_capture.py" find "$keys/clear.cap" "$marker" 16 ||
  { echo "FAIL: wire_capture did not see the marker sent in clear: the encryption check below would prove nothing"; exit 1; }

port=$(( 20000 + $$ % 20000 ))
capture "$keys/curve.cap"
ip netns exec "$ns" "$worker" --join "tcp://$host_ip:$port" --name far --plugin "$plugin" \
  --key "$keys/impostor.key_secret" --session-key "$keys/session.key" 2>"$keys/impostor.log" &
children+=("$!")
ip netns exec "$ns" "$worker" --join "tcp://$host_ip:$port" --name far --plugin "$plugin" \
  --key "$keys/far.key_secret" --session-key "$keys/session.key" --once &
worker_pid=$!
children+=("$worker_pid")
BLOCKFLOW_TWO_HOST_LISTEN="tcp://$host_ip:$port" BLOCKFLOW_TWO_HOST_KEYS="$keys" BLOCKFLOW_TWO_HOST_IMPOSTOR=1 \
  "$tests" "[.two-host]"
worker_status=0
wait "$worker_pid" || worker_status=$?
[ "$worker_status" -eq 0 ] || { echo "FAIL: the worker in $ns exited with $worker_status"; exit 1; }
grep -q "the session refused this worker's key" "$keys/impostor.log" ||
  { echo "FAIL: the impostor was not told it was refused:"; cat "$keys/impostor.log"; exit 1; }
stop_capture
found=0
"$python" "$here/wire_capture.py" find "$keys/curve.cap" "$marker" 16 || found=$?
[ "$found" -eq 1 ] || { echo "FAIL: the tensors crossed the wire in clear (or the capture failed: $found)"; exit 1; }
echo "two-host: worker in another namespace over CURVE (impostor refused, no tensor bytes in clear): PASS"

if [ -n "$serve" ]; then
  # serve prints "serving on ENDPOINT" and runs until its stdin closes.
  coproc SERVE {
    exec "$serve" --endpoint "tcp://$host_ip:$(( port + 1 ))" --key "$keys/session.key_secret" \
      --authorized-keys "$keys/clients"
  }
  children+=("$SERVE_PID")
  serve_pid=$SERVE_PID
  read -r -t 60 line <&"${SERVE[0]}" || { echo "FAIL: serve did not start"; exit 1; }
  endpoint=${line#serving on }
  echo "two-host: serve at $endpoint"
  ip netns exec "$ns" "$python" "$client" "$endpoint" --key "$keys/alice.key_secret" --server-key "$keys/session.key"
  exec {SERVE[1]}>&-
  wait "$serve_pid"
  echo "two-host: Python client in another namespace over CURVE: PASS"
fi
echo "two-host: PASS"
