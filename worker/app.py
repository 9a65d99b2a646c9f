"""The worker process: wires transports into the loop, consumes turn work, shuts down gracefully.

On SIGTERM or SIGINT it stops consuming, gives the steps in hand ``grace_s`` to
finish, then cancels what is left: those messages were never acked, so the
broker redelivers them and another worker redoes the step from the last save.
Shutdown has a hard deadline (``grace_s`` plus ``SHUTDOWN_SLACK_S``,
``worker.runtime.shutdown``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry

from contracts import topology as t
from contracts.runtime import amqp, event_loop
from contracts.runtime.health import HealthServer
from contracts.runtime.redis_client import RedisUnreachableError, check, redis_client
from contracts.runtime.tls import TlsConfigError
from worker.errors import ConfigError, ProfileError
from worker.loop import Loop
from worker.loop.streaming import StreamSettings
from worker.model.providers import build_models, check_providers, endpoints
from worker.model.ratelimit import RedisRateLimiter
from worker.profiles.agents import AgentProfile, AgentProfiles
from worker.profiles.hooksets import HookSets
from worker.profiles.source import ProfileSource
from worker.redaction import REDACT
from worker.redaction.service import Redaction
from worker.redaction.vault import RedisVault
from worker.runtime import collector
from worker.runtime.counting_sink import CountingSink
from worker.runtime.heap import HeapTrimmer, malloc_trim
from worker.runtime.metrics import WorkerMetrics, build_info
from worker.runtime.shutdown import SHUTDOWN_SLACK_S, exit_after
from worker.runtime.tenancy import Tenancy
from worker.runtime.tenant_label import tenant_label
from worker.runtime.tracing import Tracing
from worker.sequencing.erasure import forgetting
from worker.sequencing.sequencer import SessionSequencer
from worker.session.history_cache import HistoryCache
from worker.session.leases import LeaseKeeper
from worker.session.memories import SessionMemories
from worker.session.port import StepSession
from worker.session.records import SessionRecords
from worker.session.store import RedisStore
from worker.settings import Settings, load_settings, price_table
from worker.transport.broker_gate import BrokerGate
from worker.transport.catalog import RegistryCatalog
from worker.transport.consumer import Consumer
from worker.transport.events import AmqpEventSink, FilteredSink, enabled_events
from worker.transport.outbox import Outbox
from worker.transport.publish import ConfirmedPublisher
from worker.transport.rpc import ToolRPC
from worker.transport.session_reads import SessionReads
from worker.transport.topology import SESSIONS_ARGUMENTS, TURNS_ARGUMENTS, declare

log = logging.getLogger("loopwire.worker")


DEFAULT_PROFILES = AgentProfiles(agents=(AgentProfile(name="default"),))


def load_profiles(settings: Settings) -> AgentProfiles:
    if settings.agents_file is None:
        return DEFAULT_PROFILES
    try:
        return AgentProfiles.load(settings.agents_file)
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
        raise ProfileError(f"agents file {settings.agents_file}: {exc}") from None


class Worker:
    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.registry = registry or CollectorRegistry()
        self.metrics = WorkerMetrics(
            self.registry,
            default_model=settings.model.model,
            tenants=tenant_label(settings.tenants),
        )
        build_info(self.registry, component="worker", service="worker")
        self.amqp_metrics = amqp.AmqpMetrics(self.registry)
        self.profiles = load_profiles(settings)
        problems = check_providers(self.profiles.agents, endpoints(settings))
        if problems:
            raise ProfileError("; ".join(problems))
        self.source: ProfileSource | None = None
        """The profiles in use once it runs (reloaded on SIGHUP and when the file changes)."""
        self.in_flight: set[asyncio.Task[None]] = set()
        self.consuming = False
        self.stopping = asyncio.Event()

    async def run(self, *, on_ready: Callable[[], None] | None = None) -> None:
        s = self.settings
        redis = redis_client(
            s.redis_url,
            cluster=s.redis_cluster,
            max_connections=s.redis_max_connections,
            timeout=s.redis_timeout_s,
            tls=s.redis_tls,
        )
        await check(redis, s.redis_url)
        redaction = Redaction(RedisVault(redis), default_ttl_s=s.state_ttl_s)
        source = self.source = ProfileSource(
            self.profiles,
            HookSets(self.profiles, redaction),
            path=s.agents_file,
            providers=endpoints(s),
            redaction=redaction,
            on_loaded=lambda loaded: self.metrics.agents_loaded(loaded.agents, s.model.model),
            on_error=self.metrics.reload_errors.inc,
        )
        urls = amqp.resolve_urls(s.amqp_url, s.amqp_urls)
        user = _own_user(urls, s.worker_users)
        connection = await amqp.connect(
            urls,
            name=f"loopwire-worker-{os.getpid()}",
            reconnect_interval_s=s.reconnect_interval_s,
            metrics=self.amqp_metrics,
            tls=s.amqp_tls,
        )
        gate = BrokerGate()
        gate.watch(connection)
        tracing = Tracing.started(functools.partial(_redacts, source))
        model, clients = build_models(
            s,
            on_fallback=self.metrics.model_fallback,
            wrap=tracing.model if tracing is not None else None,
        )
        health: HealthServer | None = None
        background: set[asyncio.Task[None]] = set()
        try:
            consume_channel = await connection.channel(publisher_confirms=False)
            await consume_channel.set_qos(prefetch_count=s.prefetch)
            publish_channel = await connection.channel(publisher_confirms=True)
            rpc_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            topo = await declare(publish_channel)
            announced = enabled_events(s.events)
            sink = FilteredSink(
                CountingSink(
                    AmqpEventSink(
                        ConfirmedPublisher(publish_channel, topo.events.name),
                        traced=tracing is not None,
                    ),
                    self.metrics,
                ),
                announced,
            )
            rpc = ToolRPC(
                rpc_channel,
                in_progress=self.metrics.tool_call_in_progress,
                traced=tracing is not None,
            )
            await rpc.start()
            tools = rpc if tracing is None else tracing.tools(rpc)
            catalog = RegistryCatalog(redis, cache_s=s.tools_cache_s)
            store = RedisStore(
                redis,
                lease_ttl_s=s.lease_ttl_s,
                ttl_s=s.state_ttl_s,
                timed=self.metrics.store_timer,
                state_format=s.state_format,
                history_cache=HistoryCache(s.history_cache_mb << 20, s.history_cache_min_kb << 10)
                if s.history_cache_mb
                else None,
            )

            price = price_table(s)
            limiter = None
            if s.model.requests_per_minute or s.model.tokens_per_minute:
                limiter = RedisRateLimiter(
                    redis,
                    endpoint=s.model.base_url,
                    requests_per_minute=s.model.requests_per_minute,
                    tokens_per_minute=s.model.tokens_per_minute,
                )

            streaming = StreamSettings(s.stream_interval_s, s.stream_max_chars)
            tenancy = Tenancy.of(s, redis, {*s.worker_users, *([user] if user else [])})

            def loop_factory(session: StepSession, profile: AgentProfile, redone: bool) -> Loop:
                return Loop(
                    model=model,
                    tools=tools,
                    catalog=catalog,
                    store=session,
                    events=sink,
                    hooks=source.hook_sets.for_agent(profile.name),
                    observer=self.metrics,
                    price=price,
                    ledger=store,
                    limiter=limiter,
                    announced=announced,
                    stream_settings=streaming,
                    redone=redone,
                    tenant_budget=tenancy.budget,
                    tenant_limiter=tenancy.rates.of if tenancy.rates is not None else None,
                )

            records = SessionRecords(redis)
            memories = SessionMemories(s.memory.database_url) if s.memory.database_url else None
            work = SessionSequencer(
                store=store,
                slots=tenancy.slots,
                leases=LeaseKeeper(
                    store, lost=self.metrics.steps_abandoned.labels("lease_lost").inc
                ),
                profiles=source,
                loop_factory=loop_factory,
                events=sink,
                observer=self.metrics,
                deliver=redaction.deliver_for(source.redaction_configs),
                records=records,
                forget=forgetting(store.history_cache, memories),
                tracing=tracing,
            )
            consumer = Consumer(
                work=work,
                publisher=ConfirmedPublisher(publish_channel),
                dead_letters=ConfirmedPublisher(publish_channel, t.DEAD_LETTER_EXCHANGE),
                events=sink,
                busy_retry_s=s.busy_retry_s,
                max_step_attempts=s.max_step_attempts,
                metrics=self.metrics,
                broker_up=gate.up,
                in_flight=self.in_flight,
                user=user,
                workers=s.worker_users,
                tenants=tenancy.tenants,
                intake=ConfirmedPublisher(publish_channel, t.INTAKE_EXCHANGE),
                lanes=frozenset(tenancy.intake.tenants),
            )
            # declared (not just looked up) on this channel so the robust channel restores it
            # and its consumer after a reconnect
            queue = await consume_channel.declare_queue(
                t.TURNS_QUEUE, durable=True, arguments=TURNS_ARGUMENTS
            )
            reads_queue = await consume_channel.declare_queue(
                t.SESSIONS_QUEUE, durable=True, arguments=SESSIONS_ARGUMENTS
            )
            reads = SessionReads(
                records,
                Outbox(ConfirmedPublisher(publish_channel)),
                ConfirmedPublisher(publish_channel, t.DEAD_LETTER_EXCHANGE),
                tenancy.tenants,
                self.metrics,
            )

            if s.http_port:

                async def redis_ok() -> bool:
                    return bool(await redis.ping())

                async def consumer_ok() -> bool:
                    # a robust connection is not "closed" while it reconnects: ask whether it is
                    # up with every channel restored
                    return self.consuming and gate.up.is_set()

                health = HealthServer(
                    registry=self.registry,
                    checks={"consumer": consumer_ok, "redis": redis_ok},
                    port=s.http_port,
                )
                await health.start()
            trim = malloc_trim() if s.heap_trim_s > 0 else None
            if trim is not None:
                trimmer = HeapTrimmer(
                    trim,
                    s.heap_trim_s,
                    handled=lambda: consumer.handled,
                    in_flight=lambda: len(self.in_flight),
                )
                background.add(asyncio.create_task(trimmer.run()))
            collector.tune(s.gc_young_threshold)  # what was built so far lives as long as we do
            tag = await queue.consume(consumer.handle)
            await tenancy.intake.start(consume_channel, consumer.handle)
            reads_tag = await reads_queue.consume(reads.handle)
            self.consuming = True
            log.info("worker consuming %s (prefetch %d)", t.TURNS_QUEUE, s.prefetch)
            if on_ready is not None:
                on_ready()
            await self.stopping.wait()
            log.info("stopping: no new work; %d step(s) in hand", len(self.in_flight))
            await queue.cancel(tag)
            await tenancy.intake.stop()
            await reads_queue.cancel(reads_tag)
            self.consuming = False
            await self._drain(s.grace_s)
        finally:
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if health is not None:
                await health.stop()
            for client in clients:
                await client.close()
            if memories is not None:
                await memories.close()
            await connection.close()
            await redis.aclose()
            _stop_tracing(tracing)

    async def _drain(self, grace_s: float) -> None:
        pending = set(self.in_flight)
        if not pending:
            return
        _done, still = await asyncio.wait(pending, timeout=grace_s)
        for task in still:
            task.cancel()
        for task in still:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if still:
            log.warning("abandoned %d step(s) at shutdown; they will be redone", len(still))

    def stop(self) -> None:
        self.stopping.set()

    def reload(self) -> None:
        """SIGHUP: load the agents file again (a file that fails to load changes nothing)."""
        if self.source is not None:
            self.source.reload()


def _own_user(urls: Sequence[str], workers: Sequence[str]) -> str | None:
    """The AMQP user this worker publishes as (every address with the same one): its URL's,
    or, for a certificate login, the first of ``LOOPWIRE_WORKER_USERS``."""
    user = amqp.login(urls[0]) or (workers[0] if workers else None)
    if user is None:
        log.warning(
            "the AMQP login is a client certificate and LOOPWIRE_WORKER_USERS is not set: this "
            "worker cannot vouch for the child turns it starts, which workers then refuse"
        )
    return user


def _redacts(source: ProfileSource, agent: str) -> bool:
    """Whether an agent's contents stay out of its spans: it redacts, or it is not known."""
    profile = source.get(agent)
    return profile is None or REDACT in profile.hooks


def _stop_tracing(tracing: Tracing | None) -> None:
    if tracing is not None:
        tracing.shutdown()


def main() -> int:
    try:
        settings = load_settings()
    except ConfigError as exc:  # before logging is set up: one line, naming the variable
        sys.stderr.write(f"error: {exc}\n")
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for noisy in ("aiormq", "aio_pika", "httpx2"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))
    try:
        worker = Worker(settings)
    except ProfileError as exc:
        log.error("%s", exc)
        return 2

    def stop() -> None:
        worker.stop()
        exit_after(settings.grace_s + SHUTDOWN_SLACK_S)

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        loop.add_signal_handler(signal.SIGHUP, worker.reload)
        await worker.run()

    try:
        event_loop.run(runner(), settings.event_loop)
    except ProfileError as exc:  # a hook set that does not resolve
        log.error("%s", exc)
        return 2
    except TlsConfigError as exc:
        log.error("%s", exc)
        return 2
    except (amqp.AmqpUnreachableError, RedisUnreachableError) as exc:  # names the address
        log.error("%s", exc)
        return 1
    return 0
