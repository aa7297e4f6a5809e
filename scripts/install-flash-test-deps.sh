#!/bin/sh
# Debian packages that the flash tests need: a real sshd (the tests start their own on loopback)
# and mosquitto (the private brokers of the bus tests). Run as root; safe to run again.
set -eu
if command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; then
    if command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; then
        echo "openssh-server and mosquitto are already installed"
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# The package's own sshd service is not started here: the tests run sshd themselves.
apt-get install -y -q --no-install-recommends openssh-server openssh-client mosquitto
