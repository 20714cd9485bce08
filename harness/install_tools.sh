#!/usr/bin/env bash
# `make tools`: the Debian packages the tests run, each installed only when its commands are missing;
# with --bench (`make bench`), also those only the benchmarks run.
#   docker-compose  parses docker-compose.yml (tests/integration/test_compose.py; no Docker engine)
#   prometheus      promtool checks and unit-tests deploy/prometheus/alerts.yml; a test runs the server
#   haproxy         a real load balancer in front of the proxy, sending PROXY protocol headers
#   tmux            a real terminal for `kthrottle top` (tests/integration/test_connections_view.py)
#   tcpdump         (--bench) times gold's requests on the wire (bench/gold_legs.py)
# Packages that ship a service (prometheus, haproxy) would start it and take its port (:9090 is the
# compose stack's): a policy-rc.d that answers 101 keeps them from starting (containers ship one
# already and have no init system), and where systemd runs the services are disabled.
set -euo pipefail

missing=()
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
if [ "${1:-}" = --bench ]; then
  command -v tcpdump >/dev/null 2>&1 || missing+=(tcpdump)
fi
[ ${#missing[@]} -eq 0 ] && exit 0

echo "installing Debian's ${missing[*]} (for the tests: see harness/install_tools.sh)"
apt-get update -qq
own_policy=
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  own_policy=1
fi
status=0
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" || status=$?
if [ -n "$own_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
if [ -d /run/systemd/system ]; then
  systemctl disable --now prometheus haproxy >/dev/null 2>&1 || true
fi
exit $status
