#!/usr/bin/env bash
# Best effort: Debian's headless Chromium for the suite's browser test (the batch runs pages), when it
# is missing and this user may install packages. `make test` runs it beside the suite; the browser
# test runs late and skips, saying why, when /usr/bin/chromium is still absent by then.
set -u
if [ -x /usr/bin/chromium ]; then
  echo "chromium: already installed ($(/usr/bin/chromium --version 2>/dev/null))"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "chromium: not installed and this user cannot apt-get install it; the browser test will skip"
  exit 0
fi
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
if timeout 300 apt-get update -qq && timeout 300 apt-get install -y -qq --no-install-recommends chromium >/dev/null; then
  echo "chromium: installed in $(( $(date +%s) - start )) s ($(/usr/bin/chromium --version 2>/dev/null))"
else
  echo "chromium: apt-get install failed after $(( $(date +%s) - start )) s; the browser test will skip"
fi
exit 0
