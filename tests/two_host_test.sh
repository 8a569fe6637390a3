#!/usr/bin/env bash
# Two hosts on one machine: a second network namespace joined to this one by a veth pair, with its
# own address. In it run (1) a blockflow-worker that joins a session of this namespace over TCP and
# (2) the Python client example, submitting to the `serve` example over TCP. Exits 77 (ctest: skipped)
# with a message where namespaces cannot be made.
#
#   two_host_test.sh BLOCKFLOW_TESTS WORKER PLUGIN [SERVE PYTHON_CLIENT PYTHON]
set -euo pipefail

tests=$1 worker=$2 plugin=$3 serve=${4:-} client=${5:-} python=${6:-/usr/bin/python3}
: "$plugin"  # the tests binary names the plugin itself; passed so ctest rebuilds it first

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
cleanup() {
  for pid in "${children[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  ip netns del "$ns" 2>/dev/null || true
  ip link del "$veth_host" 2>/dev/null || true
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

port=$(( 20000 + $$ % 20000 ))
ip netns exec "$ns" "$worker" --join "tcp://$host_ip:$port" --name far --once &
worker_pid=$!
children+=("$worker_pid")
BLOCKFLOW_TWO_HOST_LISTEN="tcp://$host_ip:$port" "$tests" "[.two-host]"
worker_status=0
wait "$worker_pid" || worker_status=$?
[ "$worker_status" -eq 0 ] || { echo "FAIL: the worker in $ns exited with $worker_status"; exit 1; }
echo "two-host: worker in another namespace over TCP: PASS"

if [ -n "$serve" ]; then
  # serve prints "serving on ENDPOINT" and runs until its stdin closes.
  coproc SERVE { exec "$serve" --endpoint "tcp://$host_ip:$(( port + 1 ))"; }
  children+=("$SERVE_PID")
  serve_pid=$SERVE_PID
  read -r -t 60 line <&"${SERVE[0]}" || { echo "FAIL: serve did not start"; exit 1; }
  endpoint=${line#serving on }
  echo "two-host: serve at $endpoint"
  ip netns exec "$ns" "$python" "$client" "$endpoint"
  exec {SERVE[1]}>&-
  wait "$serve_pid"
  echo "two-host: Python client in another namespace over TCP: PASS"
fi
echo "two-host: PASS"
