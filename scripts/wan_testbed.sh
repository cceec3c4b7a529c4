#!/usr/bin/env bash
# The internet as home users meet it, in network namespaces on this machine
# (issue 66): a public host, and homes whose one machine sits behind a NAT
# router (nftables masquerade, no port forwarded, nothing in unless it
# answers something sent out) with a capped uplink.
#
#   scripts/wan_testbed.sh up [HOMES]   # default 4
#   scripts/wan_testbed.sh forward K PORT   # home K's router forwards TCP PORT to its machine
#   scripts/wan_testbed.sh down
#
# Environment: NLW_PREFIX (namespace and link names, default "nlw"; at most
# 5 characters), NLW_SAME_LAN=1 (every home's machine is 10.0.0.2, as many
# home routers hand out), NLW_UPLINK and NLW_DOWNLINK (tc rates, default
# 20mbit and 100mbit; "off" for none), NLW_NAT (the routers' NAT: "eim",
# default, nftables masquerade, which keeps a connection's port where it can,
# so a local port maps to one public port whatever the destination; or
# "random", masquerade random, a new public port for every connection, as a
# symmetric NAT: no hole can be punched through it).
#
# Namespaces: PREFIX-pub (the public host, 198.51.100.1; it also routes
# between the routers' WAN addresses, as the internet does), PREFIX-rK (home
# K's router: WAN 100.64.K.2, LAN 10.0.K.1) and PREFIX-hK (home K's machine,
# 10.0.K.2). Run a program in one with `ip netns exec PREFIX-h1 ...`.
# Needs root, ip, tc and nft. `down` removes everything `up` made; so does a
# failed `up`.
set -euo pipefail
P=${NLW_PREFIX:-nlw}
UP=${NLW_UPLINK:-20mbit}
DOWN=${NLW_DOWNLINK:-100mbit}
case "${NLW_NAT:-eim}" in
  eim) MASQUERADE=masquerade ;;
  random) MASQUERADE="masquerade random" ;;
  *) echo "wan_testbed: NLW_NAT is eim or random, not '${NLW_NAT}'" >&2; exit 2 ;;
esac
PUBLIC=198.51.100.1

down() {
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$P-(pub|r[0-9]+|h[0-9]+)$" || true); do
    ip netns delete "$ns"
  done
}

cap() {  # namespace, device, rate: a token bucket on what leaves through the device
  [ "$3" = off ] || ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$3" burst 64kb latency 200ms
}

home() {
  local k=$1 lan=10.0.$1
  [ "${NLW_SAME_LAN:-0}" = 1 ] && lan=10.0.0
  ip netns add "$P-r$k"
  ip netns add "$P-h$k"
  ip -n "$P-r$k" link set lo up
  ip -n "$P-h$k" link set lo up
  # The router's WAN link to the public side.
  ip link add "$P-w$k" type veth peer name "$P-x$k"
  ip link set "$P-w$k" netns "$P-pub"
  ip link set "$P-x$k" netns "$P-r$k"
  ip -n "$P-r$k" link set "$P-x$k" name wan
  ip -n "$P-pub" addr add "100.64.$k.1/24" dev "$P-w$k"
  ip -n "$P-pub" link set "$P-w$k" up
  ip -n "$P-r$k" addr add "100.64.$k.2/24" dev wan
  ip -n "$P-r$k" link set wan up
  ip -n "$P-r$k" route add default via "100.64.$k.1"
  # The home's LAN: one machine.
  ip link add "$P-l$k" type veth peer name "$P-e$k"
  ip link set "$P-l$k" netns "$P-r$k"
  ip link set "$P-e$k" netns "$P-h$k"
  ip -n "$P-r$k" link set "$P-l$k" name lan
  ip -n "$P-h$k" link set "$P-e$k" name eth0
  ip -n "$P-r$k" addr add "$lan.1/24" dev lan
  ip -n "$P-r$k" link set lan up
  ip -n "$P-h$k" addr add "$lan.2/24" dev eth0
  ip -n "$P-h$k" link set eth0 up
  ip -n "$P-h$k" route add default via "$lan.1"
  ip netns exec "$P-r$k" sysctl -qw net.ipv4.ip_forward=1
  ip netns exec "$P-r$k" nft -f - <<NFT
table ip home {
  chain postrouting { type nat hook postrouting priority 100; oifname "wan" $MASQUERADE; }
  chain forward { type filter hook forward priority 0; policy drop; ct state established,related accept; iifname "lan" accept; }
  chain input { type filter hook input priority 0; policy drop; ct state established,related accept; iifname { "lan", "lo" } accept; }
}
NFT
  cap "$P-r$k" wan "$UP"
  cap "$P-r$k" lan "$DOWN"
}

up() {
  local homes=${1:-4}
  [ "$(id -u)" -eq 0 ] || { echo "wan_testbed: needs root (network namespaces)" >&2; exit 2; }
  for tool in ip tc nft; do
    command -v "$tool" > /dev/null || { echo "wan_testbed: $tool not found (scripts/setup.sh installs it)" >&2; exit 2; }
  done
  down
  trap 'down' ERR
  ip netns add "$P-pub"
  ip -n "$P-pub" link set lo up
  ip -n "$P-pub" addr add "$PUBLIC/32" dev lo
  ip netns exec "$P-pub" sysctl -qw net.ipv4.ip_forward=1
  for k in $(seq 1 "$homes"); do home "$k"; done
  trap - ERR
  echo "wan_testbed: public host $PUBLIC in $P-pub; homes $P-h1..$P-h$homes behind NAT routers (uplink $UP)"
}

forward() {  # home, port: what a user does in a router's "port forwarding" page
  local k=$1 port=$2 machine
  machine=$(ip -n "$P-h$k" -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)
  ip netns exec "$P-r$k" nft -f - <<NFT
table ip home {
  chain prerouting { type nat hook prerouting priority -100; iifname "wan" tcp dport $port dnat to $machine; }
  chain forward { ct status dnat accept; }
}
NFT
}

case "${1:-}" in
  up) up "${2:-4}" ;;
  forward) [ $# -eq 3 ] || { echo "usage: $0 forward HOME PORT" >&2; exit 2; }; forward "$2" "$3" ;;
  down) down ;;
  *) echo "usage: $0 up [HOMES] | forward HOME PORT | down" >&2; exit 2 ;;
esac
