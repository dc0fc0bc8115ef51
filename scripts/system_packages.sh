#!/usr/bin/env bash
# The Debian packages a make target drives for real, installed when missing: the one list, used by the Makefile and
# by .ci/run alike. Usage: scripts/system_packages.sh test|demo-tools
#   test        Chromium (browser tests; Playwright's own browser download is not reachable), PostgreSQL 15 (the
#               production-profile tests start their own cluster), bubblewrap (jails each sandbox of the local
#               sandbox server), redis-server (the Celery broker of the deployment rehearsal)
#   demo-tools  bubblewrap
# As root (or with passwordless sudo) it installs what is missing; otherwise it stops with one line naming the command.
set -euo pipefail
missing=()
need() { # need <package> <test that succeeds when it is installed>
  local pkg=$1; shift
  "$@" >/dev/null 2>&1 || missing+=("$pkg")
}
case "${1:-}" in
  test)
    need chromium command -v chromium
    need postgresql test -x /usr/lib/postgresql/15/bin/initdb
    need bubblewrap command -v bwrap
    need redis-server command -v redis-server
    ;;
  demo-tools)
    need bubblewrap command -v bwrap
    ;;
  *)
    echo "usage: $0 test|demo-tools" >&2
    exit 2
    ;;
esac
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    echo "error: missing Debian packages ${missing[*]}; run: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi
echo "installing Debian packages: ${missing[*]}" >&2
$sudo apt-get install -y -q "${missing[@]}" >/dev/null ||
  { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q "${missing[@]}" >/dev/null; }
