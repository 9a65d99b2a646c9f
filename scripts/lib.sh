# Shared helpers for scripts/*: a virtualenv with the project, and the local services
# (ensure_services: RabbitMQ and Redis; ensure_test_services: what the test suites need besides).
# shellcheck shell=bash

PYTHON="${PYTHON:-python3}"

ensure_venv() {
    if [[ ! -x .venv/bin/python ]]; then
        echo "creating .venv with $($PYTHON --version)" >&2
        "$PYTHON" -m venv .venv
    fi
    if ! .venv/bin/python -c "import worker, contracts, tool_services, pytest_asyncio" 2>/dev/null \
        || [[ pyproject.toml -nt .venv/.installed ]]; then
        echo "installing loopwire and its dependencies into .venv" >&2
        .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' >&2
        touch .venv/.installed
    fi
}

port_open() {
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

wait_port() {
    local host=$1 port=$2 what=$3
    for _ in $(seq 1 60); do
        port_open "$host" "$port" && return 0
        sleep 1
    done
    echo "error: $what did not come up on $host:$port" >&2
    return 1
}

ensure_services() {
    if ! port_open 127.0.0.1 6379; then
        if command -v redis-server >/dev/null; then
            echo "starting redis-server on 127.0.0.1:6379" >&2
            redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
        else
            echo "error: Redis is not reachable on 127.0.0.1:6379 and redis-server is not installed" >&2
            echo "       install it (e.g. 'apt-get install redis-server') or set LOOPWIRE_REDIS_URL" >&2
            return 1
        fi
        wait_port 127.0.0.1 6379 Redis
    fi
    if ! port_open 127.0.0.1 5672; then
        if command -v rabbitmq-server >/dev/null; then
            echo "starting rabbitmq-server on 127.0.0.1:5672" >&2
            rabbitmq-server -detached >/dev/null 2>&1 || true
        else
            echo "error: RabbitMQ is not reachable on 127.0.0.1:5672 and rabbitmq-server is not installed" >&2
            echo "       install it (e.g. 'apt-get install rabbitmq-server') or set LOOPWIRE_AMQP_URL" >&2
            return 1
        fi
        wait_port 127.0.0.1 5672 RabbitMQ
    fi
}

# What the test suites need besides RabbitMQ and Redis (the demo needs none of it): PostgreSQL
# for the memory service, RabbitMQ's Prometheus plugin, prometheus/promtool and Chromium
# (the last two installed with apt-get when missing and run as root).
ensure_test_services() {
    # PostgreSQL: the memory service's store (docs/memory.md)
    if ! port_open 127.0.0.1 5432; then
        if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
            echo "starting PostgreSQL on 127.0.0.1:5432" >&2
            pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
        elif command -v pg_ctl >/dev/null; then
            # a cluster of our own, owned by the postgres user (it refuses to run as root)
            data="${LOOPWIRE_PG_DATA:-/tmp/loopwire-pg}"
            if [ ! -s "$data/PG_VERSION" ]; then
                mkdir -p "$data" && chown postgres "$data" 2>/dev/null || true
                su postgres -c "initdb -D '$data' -A trust -U postgres" >/dev/null
            fi
            su postgres -c "pg_ctl -D '$data' -o '-p 5432 -k /tmp -c listen_addresses=127.0.0.1' -l '$data/log' start" >/dev/null
        else
            echo "error: PostgreSQL is not reachable on 127.0.0.1:5432 and is not installed" >&2
            echo "       install it (e.g. 'apt-get install postgresql') for the memory service" >&2
            return 1
        fi
        wait_port 127.0.0.1 5432 PostgreSQL
    fi
    # RabbitMQ's Prometheus plugin (the dashboard's queue panels read it on :15692)
    if ! port_open 127.0.0.1 15692 && command -v rabbitmq-plugins >/dev/null; then
        rabbitmq-plugins enable rabbitmq_prometheus >/dev/null 2>&1 || true
    fi
    # Prometheus and promtool: the alert rules' tests and the dashboard's end-to-end test
    if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            echo "installing Debian's prometheus package (prometheus, promtool)" >&2
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 \
                || { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; } \
                || echo "warning: could not install prometheus; the alert and dashboard tests will fail" >&2
        else
            echo "warning: prometheus and promtool are not installed (apt-get install prometheus)" >&2
        fi
    fi
    # Chromium: the browser tests (tests/browser) drive Debian's build through Playwright,
    # which cannot download browsers of its own here
    if [ ! -x /usr/bin/chromium ]; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            echo "installing Debian's chromium package (/usr/bin/chromium, for tests/browser)" >&2
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
                || { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; } \
                || echo "warning: could not install chromium; the browser tests will fail" >&2
        else
            echo "warning: /usr/bin/chromium is not installed (apt-get install chromium)" >&2
        fi
    fi
}
