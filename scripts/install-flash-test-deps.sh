#!/bin/sh
# Debian's openssh-server for the flash tests, which start their own sshd on a loopback port
# (the package's own service is not used). Safe to run again; quick when installed.
set -eu
if [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends openssh-server openssh-client
