"""TransferEngine: the article's API, on the daemon's loop, over domain groups.

Every submit checks and plans on the daemon's loop (bad input fails at once,
with nothing sent), takes a slot of the engine's bounded queue, and hands the
parts to the worker of its source region's domain group, which owns that
group's sockets.  A worker is the daemon's own loop (``engine.worker =
"loop"``: the hand-off is a plain call) or a pinned thread of its own
(``"thread"``); see :mod:`transferd.workers`.  Completion comes back to the
daemon's loop as the resolution of an asyncio future.  Receiver-side events
(an immediate count reached, a message arrived) are delivered through
callbacks on the daemon's loop.

``engine.host_groups`` host groups each bind every rail (a port each);
registered regions are dealt to them in turn (:meth:`TransferEngine.group_of`),
and a region's MrDesc names its group's rails, so both the writes from it
and the writes into it run on that group.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from transferd import tracing
from transferd.config import EngineConfig
from transferd.copies import COUNTING, count
from transferd.domains import registry
from transferd.domains.base import DomainOptions
from transferd.domains.group import DomainGroup
from transferd.fds import LinkBudget, link_budget
from transferd.logs import trace_fields
from transferd.memory import Buffer, BufferTable, Ref
from transferd.memory.staging import Claim
from transferd.metrics import Metrics
from transferd.parts import ReadPart
from transferd.protocol import crc, trace
from transferd.protocol.errors import BadRequest, OverLimit, TransferdError
from transferd.protocol.integers import unsigned
from transferd.protocol.keyring import Keyring
from transferd.protocol.peer_coverage import MAX_PIECES
from transferd.protocol.peer_handshake import node_of
from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst
from transferd.workers import Slots, Worker, make_worker
from transferd.workers.affinity import allowed_cpus, choose_cpu

from .device_source import plan_staging
from .expectations import Expectations
from .immcounter import ImmCounter
from .inflight import Entry, InFlight, Stage, incoming
from .limits import MAX_MESSAGE
from .peer_groups import PeerGroups
from .peer_slots import PeerSlots
from .plan import (
    VERIFY_PART,
    SendPart,
    WritePart,
    plan_barrier,
    plan_paged,
    plan_single,
)
from .port import EnginePort
from .reads import Reads
from .receives import Deliver, Receives
from .regions import Region, RegionTable
from .secret import load_secret, loopback
from .transfer import Transfer
from .write_scope import WriteIdScope

# What a SEND's message costs the host limit besides its bytes (its part, frame, entry).
SEND_OVERHEAD = 256

# What `transferd inflight` calls a transfer, by its parts' type.
_KINDS: dict[type, str] = {WritePart: "write", ReadPart: "read", SendPart: "send"}

log = logging.getLogger("transferd.engine")


class TransferEngine:
    def __init__(self, config: EngineConfig, buffers: BufferTable, metrics: Metrics | None,
                 default_host: str = "127.0.0.1", *, secret: Keyring | None = None) -> None:
        self.config = config
        self.buffers = buffers
        self.metrics = metrics
        # [ok, error, bytes out]: every transfer's end adds to it, a scrape folds it in.
        self._counted: list[int] | None = None if metrics is None else metrics.engine_tally
        # The daemon passes what it read (an empty Keyring: none); else read it here.
        self.secret = (secret or None) if secret is not None else load_secret(config)
        self.hosts = list(config.host_rails) or [default_host]
        if self.secret is None and not config.insecure and not config.host_rails \
                and not loopback(default_host):
            # Without a secret, peers cannot authenticate: a rail only the local
            # host can reach, unless told otherwise.
            self.hosts = ["127.0.0.1"]
        self.node = secrets.randbits(64) or 1
        self.regions = RegionTable(config.max_regions)
        self.counter = ImmCounter(notify=self._notify, now=self._notify_now,
                                  max_counters=config.max_counters)
        # What every group lands writes and delivers messages through.
        self.port = EnginePort(self.regions, self.counter, self._deliver, self._sender_gone,
                               max_checksums=config.max_links)
        # What the configured kind of Domain can do (asked, never its name).
        self.capabilities = registry.capabilities(config.domain)
        self._ops = itertools.count(1)
        # One-sided READs (reads.py).
        self.reads = Reads(self)
        # Write ids by the connection that submitted them (write_scope.py).
        self.write_ids = WriteIdScope(time.monotonic, config.write_id_window,
                                      config.write_id_ttl_s)
        # Taken by a transfer through device memory while it gathers its staging chunks,
        # one per pool (a device's group): a transfer waiting for one device's chunks
        # (held by transfers to a stopped peer) holds up no other device's.
        self._staging_locks: dict[Any, asyncio.Lock] = {}
        # Pages of the paged writes and reads in flight (engine.max_pages_in_flight).
        self._pages_in_flight = 0
        self.peer_groups = PeerGroups(config.max_peer_groups, config.max_group_peers,
                                      config.max_group_peers_total)
        # Posted receives and the messages waiting for them (on the daemon's loop).
        self.receives = Receives(
            lambda n: buffers.charge("cpu", n, "a peer message waiting for a receive"),
            max_pools=config.max_recv_pools, max_pools_total=config.max_recv_pools_total,
            max_waiting=config.recv_waiting_max,
            wait_s=min(config.recv_wait_s, config.peer_timeout_s / 2),
            max_length=MAX_MESSAGE)
        self.expectations = Expectations(self.counter, config.max_expectations,
                                         config.max_expectations_total)
        # What is in flight (transfers, expectations, reads) and stall warnings.
        self.inflight = InFlight(time.monotonic, config.stall_warn_s)
        self.inflight.sources.append(incoming(lambda: self.groups))
        self.inflight.sources.append(self.receives.listing)
        # Each submit's Transfer and the worker it runs on (CANCEL fails it there).
        self._transfers: dict[asyncio.Future[None], tuple[Transfer, Worker]] = {}
        # What a started transfer's end calls at once (when_finished): at most one per
        # entry of _transfers, gone with it in _finished.
        self._on_end: dict[asyncio.Future[None], Callable[[asyncio.Future[None]], None]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        # One worker and one DomainGroup per host group (engine.host_groups);
        # ``worker`` and ``group`` are the first (the main address's).
        self.workers: list[Worker] = []
        self.groups: list[DomainGroup] = []
        self.worker: Worker | None = None
        self.group: DomainGroup | None = None
        # Transfers in flight, for every group together (the daemon's bound).
        self.slots = Slots()
        # In flight or waiting, per destination peer (engine.max_inflight_per_peer).
        self.peer_slots: PeerSlots | None = None
        # Every Domain of the group reads what it needs of these (chaos: the schedule).
        # Each Domain's own settings go under its name, passed through unread.
        self.domain_options = DomainOptions(
            config.chaos_seed, config.chaos_max_delay_ms / 1000.0,
            max_links=config.max_links, fd_reserve=config.fd_reserve,
            link_idle_s=config.link_idle_s, rail_timeout_s=config.rail_timeout_s,
            link_budget=LinkBudget(link_budget(config.max_links, config.fd_reserve)),
            max_peers=config.max_peers, verify=config.verify,
            settings={"verbs": {"devices": tuple(config.rdma_devices),
                                "port": config.rdma_port,
                                "gid_index": config.rdma_gid_index},
                      "chaos": {"corrupt": config.chaos_corrupt}})

    # -- lifecycle ----------------------------------------------------------------

    @property
    def worker_kind(self) -> str:
        """engine.worker resolved: "auto" is "loop" (docs/benchmarks.md, issue 12)."""
        kind = self.config.worker
        return "loop" if kind == "auto" else kind

    async def start(self) -> NetAddr:
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.peer_slots = PeerSlots(self.loop, self.config.max_inflight_per_peer,
                                    self.config.peer_timeout_s)
        self.inflight.watch(self.loop)
        if self.secret is None:
            log.warning(
                "engine: no cluster secret (engine.secret_file): peer links are not "
                "authenticated; rails %s%s", ", ".join(self.hosts),
                " (engine.insecure: reachable beyond this host)" if self.config.insecure
                else " bound to loopback only")
        kind = self.worker_kind
        taken: Counter[int] = Counter()
        try:
            for index in range(self.config.host_groups):
                cpu = None
                if kind == "thread" and self.config.pin_workers:
                    cpu = choose_cpu((), allowed_cpus(), taken)
                    if cpu is not None:
                        taken[cpu] += 1
                worker = make_worker(kind, f"transferd-host{index}", cpu)
                worker.start()
                self.workers.append(worker)
                self.groups.append(await asyncio.wrap_future(
                    worker.run(_call(functools.partial(self._make_group, index, worker)))))
                log.info("engine group %d %s: %d rail(s), %s worker%s", index,
                         self.groups[-1].address, len(self.hosts), kind,
                         f" on cpu {cpu}" if cpu is not None else "")
        except BaseException:
            await self.close()
            raise
        self.worker, self.group = self.workers[0], self.groups[0]
        if self.secret is None:
            await self._addressed_node()
        return self.main_address()

    async def _addressed_node(self) -> None:
        """Without a cluster secret this daemon's node id is its rails' addresses (every
        group's), hashed: what a peer checks, so nobody else can claim it
        (peer_handshake.node_of).  Set before anything is published or dialled."""
        everyone = tuple(g.identity.addrs for g in self.groups)
        self.node = node_of(everyone)
        for worker, g in zip(self.workers, self.groups, strict=True):
            await asyncio.wrap_future(worker.run(_call(functools.partial(
                g.set_node, self.node, everyone))))

    def _make_group(self, index: int, worker: Worker) -> DomainGroup:
        """Group ``index`` on ``worker``'s loop, its rails bound (runs on that loop)."""
        assert worker.loop is not None
        g = DomainGroup(index, self.node, worker.loop, self.port,
                        timeout_s=self.config.peer_timeout_s,
                        domain=self.config.domain, options=self.domain_options,
                        secret=self.secret,
                        handshake_timeout_s=self.config.handshake_timeout_s)
        g.write_ids.configure(self.config.write_id_window, self.config.write_id_ttl_s,
                              worker.loop.time)
        # A fixed engine.peer_port is the first group's; the others' are the system's pick.
        g.bind(self.hosts, self.config.peer_port if index == 0 else 0)
        return g

    def set_secret(self, secret: Keyring) -> None:
        """A reloaded cluster secret: links made from now on prove it (open ones stay).

        Each handshake takes its group's keyring when it starts, so swapping the
        reference (atomic) needs no call onto the workers' loops."""
        self.secret = secret
        for group in self.groups:
            group.secret = secret

    async def close(self) -> None:
        self.inflight.close()
        self.port.close()
        for worker, group in zip(self.workers, self.groups, strict=False):
            with contextlib.suppress(TimeoutError, RuntimeError):
                await asyncio.wait_for(asyncio.wrap_future(worker.run(_call(group.close))), 5)
        for worker in self.workers:
            worker.stop()

    def _notify(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the daemon's loop, soon (from any thread, a worker's too)."""
        assert self.loop is not None
        if threading.get_ident() == self._loop_thread:
            self.loop.call_soon(fn)  # a loop worker: no wake-up to write
        else:
            self.loop.call_soon_threadsafe(fn)

    def _notify_now(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the daemon's loop: at once when called there (a landing on a loop
        worker reached an expectation: its client hears of it before the ACK goes, not a
        turn of the loop later), else soon.  What it raises is logged, as the loop would,
        and never reaches the landing that called."""
        if threading.get_ident() == self._loop_thread:
            try:
                fn()
            except Exception:
                log.exception("engine: an expectation's callback failed")
        else:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(fn)

    def group_of(self, region: Region) -> DomainGroup:
        """The host group ``region`` is dealt to (by its id, in turn)."""
        return self.groups[region.id % len(self.groups)]

    @property
    def rails(self) -> int:
        return len(self.hosts)

    def main_address(self) -> NetAddr:
        assert self.group is not None
        return self.group.address

    # -- memory ---------------------------------------------------------------------

    def next_op(self) -> int:
        return next(self._ops)

    def reg_mr(self, buffer: Buffer, access: str = "w") -> tuple[Region, MrDesc]:
        """Register ``buffer``; peers may write it (``"w"``), read it (``"r"``) or both."""
        region = self.regions.register(buffer, self.rails, access)
        group = self.group_of(region)
        try:
            # Each rail's rkey comes from the Domain that registered the memory.
            rkeys = group.register(region)
        except BaseException:
            self.regions.deregister(region.id)
            raise
        desc = MrDesc(region.ptr,
                      [(group.rail_address(i), k) for i, k in enumerate(rkeys)],
                      region.size)
        return region, desc

    def _deregistered(self, region: Region) -> None:
        if self.groups:
            self.group_of(region).deregister(region)

    def dereg_mr(self, region_id: int) -> None:
        self._deregistered(self.regions.deregister(region_id))

    def buffer_freed(self, buffer: Buffer) -> None:
        for region in self.regions.regions_of(buffer):
            self._deregistered(self.regions.deregister(region.id))

    # -- one-sided writes ------------------------------------------------------------

    def submit_single_write(self, length: int, imm: int | None, src: tuple[int, int],
                            dst: tuple[MrDesc, int], wid: int | None = None,
                            owner: Hashable = None, *, verify: bool | None = None,
                            traceparent: str | None = None) -> asyncio.Future[None]:
        """``wid``: the write id of ``owner`` (the submitting connection) for this write.
        ``verify``: a CRC32C per part (None: engine.verify); ``traceparent``: W3C."""
        self._check_descs([dst[0]])
        if wid is not None:
            self._check_wid(wid)
        # (Nothing asked and no engine.verify: the usual small write's tag, no call.)
        tag = _UNTAGGED if verify is None and traceparent is None and not self.config.verify \
            else self._tag(verify, traceparent)
        region = self.regions.get(src[0])
        if wid is not None:
            wid = self._wire_wid(owner, wid, ("single", length, imm, region.id, src[1],
                                              dst[0].node, dst[0].ptr, dst[1]))
        op = next(self._ops)
        if region.staging is not None:
            return self._from_device(op, region, [(region.ptr + src[1], length)], lambda v: _wid(
                plan_single(op, length, _imm(imm), v[0], dst[0], dst[1], self.rails,
                            max_parts=_verify_parts(length, tag)), wid, tag), owner, tag,
                "single")
        view = region.view(region.ptr + src[1], length)
        planned: list[Any] = plan_single(
            op, length, _imm(imm) if imm is not None else None, view, dst[0], dst[1],
            self.rails, max_parts=_verify_parts(length, tag) if tag[0] else None)
        if wid is not None or tag is not _UNTAGGED:
            planned = _wid(planned, wid, tag)
        groups = self.groups
        return self._submit(op, planned, region.buffer.ref(),
                            groups[region.id % len(groups)], owner, kind="single")

    def _hold_pages(self, n: int, what: str, named: str = "pages") -> Callable[[], None]:
        """Count ``n`` pages of a paged transfer (or destinations of a scatter or barrier,
        sources of a gather) in flight (engine.max_pages_in_flight): its plan holds a view
        and an address per page until it ends (about 256 bytes each, however small the
        pages: 100 PAGED_WRITES of 65,536 one-byte pages to a stopped peer took the
        daemon +1.6 GiB; 100 SCATTERs of 4,096 destinations +395 MiB). The release."""
        cap = self.config.max_pages_in_flight
        if self._pages_in_flight + n > cap:
            raise OverLimit(f"a {what} of {n} {named} would make {self._pages_in_flight + n} "
                            f"pages and destinations in flight on this daemon, over "
                            f"engine.max_pages_in_flight ({cap}): wait for some to end, or "
                            "split it")
        self._pages_in_flight += n
        left = [n]

        def release() -> None:
            k, left[0] = left[0], 0
            self._pages_in_flight -= k

        return release

    def _held(self, release: Callable[[], None],
              submit: Callable[[], asyncio.Future[None]]) -> asyncio.Future[None]:
        """``submit()``'s transfer, ``release`` called once it ended (or did not start)."""
        try:
            fut = submit()
        except BaseException:
            release()
            raise
        fut.add_done_callback(lambda _: release())
        return fut

    def submit_paged_writes(self, page_len: int, imm: int | None,
                            src: tuple[int, Pages], dst: tuple[MrDesc, Pages],
                            wid: int | None = None, owner: Hashable = None, *,
                            verify: bool | None = None, traceparent: str | None = None
                            ) -> asyncio.Future[None]:
        release = self._hold_pages(len(src[1].indices), "PAGED_WRITES")
        return self._held(release, lambda: self._paged_writes(
            page_len, imm, src, dst, wid, owner, verify=verify, traceparent=traceparent))

    def _paged_writes(self, page_len: int, imm: int | None,
                      src: tuple[int, Pages], dst: tuple[MrDesc, Pages],
                      wid: int | None, owner: Hashable, *,
                      verify: bool | None, traceparent: str | None) -> asyncio.Future[None]:
        self._check_descs([dst[0]])
        self._check_wid(wid)
        tag = self._tag(verify, traceparent)
        region = self.regions.get(src[0])
        sp, dp = src[1], dst[1]
        if len(sp.indices) != len(dp.indices):
            raise BadRequest(f"{len(sp.indices)} source pages for {len(dp.indices)} "
                             "destination pages")
        if wid is not None:
            wid = self._wire_wid(owner, wid, (
                "paged", page_len, imm, region.id, tuple(sp.indices), sp.stride, sp.offset,
                dst[0].node, dst[0].ptr, tuple(dp.indices), dp.stride, dp.offset))
        base, stride = region.ptr + sp.offset, sp.stride
        op = next(self._ops)
        if region.staging is not None:
            pages = [(base + i * stride, page_len) for i in sp.indices]
            return self._from_device(op, region, pages, lambda v: _wid(
                plan_paged(op, page_len, _imm(imm), v, dst[0], dst[1], self.rails), wid, tag),
                owner, tag, "paged")
        views = region.pages(sp.offset, stride, sp.indices, page_len)
        parts = plan_paged(op, page_len, _imm(imm), views, dst[0], dst[1], self.rails)
        return self._submit(op, _wid(parts, wid, tag), region.buffer.ref(),
                            self.group_of(region), owner, kind="paged")

    # -- one-sided reads (reads.py) ----------------------------------------------------

    def submit_single_read(self, length: int, dst: tuple[int, int],
                           src: tuple[MrDesc, int], owner: Hashable = None, *,
                           verify: bool | None = None, traceparent: str | None = None
                           ) -> asyncio.Future[None]:
        """``length`` bytes of the peer region ``src`` into our region ``dst``.  ``owner``:
        the submitting connection (inflight); ``verify``: the responder's CRC32C of what
        it sent checked against ours of what landed (None: engine.verify);
        ``traceparent``: W3C."""
        return self.reads.single(length, dst, src, owner, self._read_tag(verify, traceparent))

    def submit_paged_reads(self, page_len: int, dst: tuple[int, Pages],
                           src: tuple[MrDesc, Pages], owner: Hashable = None, *,
                           verify: bool | None = None, traceparent: str | None = None
                           ) -> asyncio.Future[None]:
        release = self._hold_pages(len(dst[1].indices), "PAGED_READS")
        return self._held(release, lambda: self.reads.paged(
            page_len, dst, src, owner, self._read_tag(verify, traceparent)))

    def submit_gather(self, dst_region: int, srcs: Sequence[tuple[int, int, MrDesc, int]],
                      owner: Hashable = None, *, verify: bool | None = None,
                      traceparent: str | None = None) -> asyncio.Future[None]:
        """Several peer ranges ``(len, dst_off, desc, src_off)`` into our region, as one."""
        release = self._hold_pages(len(srcs), "GATHER", "sources")
        return self._held(release, lambda: self.reads.gather(
            dst_region, srcs, owner, self._read_tag(verify, traceparent)))

    def _read_tag(self, verify: bool | None, traceparent: str | None) -> Tag:
        # (Nothing asked and no engine.verify: the untagged read, no call.)
        if verify is None and traceparent is None and not self.config.verify:
            return _UNTAGGED
        return self._tag(verify, traceparent, "read")

    def _check_wid(self, wid: int | None) -> None:
        """A write id this engine can honour (before anything else is looked up)."""
        if wid is None:
            return
        if not 0 <= wid <= 0xFFFFFFFFFFFFFFFF:
            raise BadRequest(f"write id {wid} is not a 64-bit unsigned value")
        if not self.capabilities.sees_writes:
            # A NIC places RDMA writes itself: no receiver code sees a retry to drop it.
            raise BadRequest(f"write ids need a Domain whose receiver sees each write "
                             f"(tcp, chaos), not {self.config.domain}")

    def _tag(self, verify: bool | None, traceparent: str | None, what: str = "write") -> Tag:
        """What a submit's parts carry besides their bytes: (verify, trace id bytes)."""
        if verify is None:
            verify = self.config.verify
        if verify:
            if not self.capabilities.sees_writes:
                # (A NIC places a READ's answer as it does a WRITE: no code of ours sees
                # its bytes on either side.)
                side = "receiver sees each write's" if what == "write" else \
                    "reader and responder see each read's"
                raise BadRequest(f"verify needs a Domain whose {side} bytes (tcp, chaos), "
                                 f"not {self.config.domain}: without one no checksum "
                                 "could be checked")
            crc.require()  # BadRequest saying what to install, where it is missing
        return (bool(verify), trace.parse(traceparent) if traceparent is not None else None)

    def _wire_wid(self, owner: Hashable, wid: int, what: Any) -> int:
        """The id ``owner``'s write ``wid`` carries on the wire (write_scope.py)."""
        return self.write_ids.wire_id(owner, wid, what)

    def staging_lock(self, io: Any) -> asyncio.Lock:
        """What a transfer through ``io``'s staging holds while it takes its chunks (all
        it needs at once, one transfer at a time, so two never hold half each): one
        lock per pool, never one for every device."""
        lock = self._staging_locks.get(io.pool)
        if lock is None:
            lock = self._staging_locks[io.pool] = asyncio.Lock()
        return lock

    def _from_device(self, op: int, region: Region, pages: list[tuple[int, int]],
                     plan: Callable[[list[memoryview]], list[WritePart | SendPart]],
                     owner: Hashable = None, tag: Tag = (False, None), kind: str = ""
                     ) -> asyncio.Future[None]:
        """A write whose source is device memory: D2H into staging, then the send.

        Each page (absolute address, length) is bounds checked now, copied into
        pinned staging of the region's group (waiting for chunks: back-pressure),
        and the parts are planned on those copies once the copies' event
        completed; the chunks go back when the transfer finished.
        """
        assert self.loop is not None
        io, devs, places, need = plan_staging(region, pages)
        held = region.buffer.ref()
        # A traced write's span starts at the submit, its staging copy included.
        traced = tag[1]
        spans = tracing.SPANS if traced is not None else None
        span = spans.transfer(kind, op, traced) if spans is not None and traced else None
        lock = self.staging_lock(io)

        async def run() -> None:
            # Back to the pool only once its copies ended, however this ends.
            claim = Claim(io)
            try:
                # One transfer takes its chunks at a time: two never hold half each.
                async with lock:
                    chunks = await claim.take(need)
                views = []
                for dev, (c, off), (_, n) in zip(devs, places, pages, strict=True):
                    io.stream.copy_d2h(chunks[c].ptr + off, dev, n)
                    views.append(chunks[c].view[off:off + n])
                await io.waiter.wait(claim.fence())
                sending = self._submit(op, plan(views), None, self.group_of(region), owner,
                                       span=span)
                # From now on cancel() of this task fails the transfer itself (a
                # cancelled task would let go of its worker slot before the transfer ended).
                me = asyncio.current_task()
                if me is not None:
                    self._transfers[me] = self._transfers[sending]
                try:
                    await sending
                finally:
                    if me is not None:
                        self._transfers.pop(me, None)
            finally:
                held.release()
                claim.release()

        # In flight from now: QUEUED while its staging copy is made (inflight.py).
        inflight = self.inflight
        inflight.add(op, "write", op=op, owner=owner, trace=tag[1], stage=Stage.QUEUED,
                     rails=(), peer=None)
        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda _: inflight.remove(op))
        if spans is not None:
            task.add_done_callback(functools.partial(spans.ended, span))
        return task

    def _check_descs(self, descs: Sequence[MrDesc]) -> None:
        """Every destination rail an IP and port, and a known peer where it is bound."""
        for group in self.groups:  # each group's links authenticated their own peers
            for d in descs:
                for rail, (addr, _) in enumerate(d.rkeys):
                    group.check_address(addr, rail)

    def add_peer_group(self, addrs: Sequence[NetAddr], owner: Hashable = None) -> int:
        """A peer group of ``addrs``, its links opened now; it goes with ``owner``."""
        self.peer_groups.room(len(addrs), owner)
        for a in addrs:
            for group in self.groups:
                group.check_address(a)
            if len(a.rails) != self.rails:
                raise BadRequest(f"rail count mismatch: peer {a} has {len(a.rails)} rail(s), "
                                 f"this daemon {self.rails}")
        gid = self.peer_groups.add(addrs, owner)
        for worker, group in zip(self.workers, self.groups, strict=True):
            for a in addrs:
                worker.call(group.connect, a)
        return gid

    def submit_scatter(self, gid: int | None, imm: int | None, src_region: int,
                       dsts: Sequence[ScatterDst], owner: Hashable = None, *,
                       verify: bool | None = None, traceparent: str | None = None
                       ) -> asyncio.Future[None]:
        release = self._hold_pages(len(dsts), "SCATTER", "destinations")
        return self._held(release, lambda: self._scatter(gid, imm, src_region, dsts, owner,
                                                         verify, traceparent))

    def _scatter(self, gid: int | None, imm: int | None, src_region: int,
                 dsts: Sequence[ScatterDst], owner: Hashable, verify: bool | None,
                 traceparent: str | None) -> asyncio.Future[None]:
        tag = self._tag(verify, traceparent)
        self.peer_groups.check(gid, [d.dst[0] for d in dsts])
        self._check_descs([d.dst[0] for d in dsts])
        region = self.regions.get(src_region)
        if region.staging is not None:
            raise BadRequest(f"a scatter from {region.buffer.device} memory is not supported "
                             "(single and paged writes are)")
        parts: list[WritePart | SendPart] = []
        first = 0
        for d in dsts:
            op = next(self._ops)
            first = first or op
            view = region.view(region.ptr + d.src, d.len)
            parts += plan_single(op, d.len, _imm(imm), view, d.dst[0], d.dst[1], self.rails,
                                 max_parts=_verify_parts(d.len, tag))
        return self._submit(first or next(self._ops), _wid(parts, None, tag),
                            region.buffer.ref(), self.group_of(region), owner, kind="scatter")

    def submit_barrier(self, gid: int | None, imm: int, dsts: Sequence[MrDesc],
                       owner: Hashable = None, *, traceparent: str | None = None
                       ) -> asyncio.Future[None]:
        """``traceparent``: carried by its zero-byte writes (no bytes: nothing to verify)."""
        traced = trace.parse(traceparent) if traceparent is not None else None
        release = self._hold_pages(len(dsts), "BARRIER", "destinations")
        return self._held(release, lambda: self._barrier(gid, imm, dsts, owner, traced))

    def _barrier(self, gid: int | None, imm: int, dsts: Sequence[MrDesc], owner: Hashable,
                 traced: bytes | None) -> asyncio.Future[None]:
        self.peer_groups.check(gid, dsts)
        self._check_descs(dsts)
        op = next(self._ops)
        parts = plan_barrier(op, _imm(imm) or 0, dsts, self.rails)
        return self._submit(op, _wid(parts, None, (False, traced)), None, None, owner,
                            kind="barrier")

    # -- two-sided ---------------------------------------------------------------------

    def submit_send(self, addr: NetAddr, msg: bytes, owner: Hashable = None, *,
                    traceparent: str | None = None) -> asyncio.Future[None]:
        """``traceparent``: on this daemon's records of it (its frame carries none)."""
        traced = trace.parse(traceparent) if traceparent is not None else None
        if len(msg) > MAX_MESSAGE:
            raise BadRequest(f"message of {len(msg)} bytes is over the limit of {MAX_MESSAGE}")
        if len(addr.rails) != self.rails:
            raise BadRequest(f"rail count mismatch: peer {addr} has {len(addr.rails)} rail(s), "
                             f"this daemon {self.rails}")
        for group in self.groups:
            group.check_address(addr)
        # The message is held here until the peer acknowledges it (or the SEND ends):
        # charged to the host memory limit meanwhile, as the receiving side charges one
        # waiting for a receive. Uncharged, a client's SENDs to a stopped peer took the
        # daemon +808 MiB a connection (1,024 of 1 MiB), as many connections as it liked.
        release = self.buffers.charge("cpu", len(msg) + SEND_OVERHEAD,
                                      "a SEND's message, held until its peer acknowledges it")
        op = next(self._ops)
        if COUNTING:
            count("engine.send_message", len(msg))
        # The message is ours now (bytes are immutable): the caller may reuse its buffer.
        return self._held(release, lambda: self._submit(
            op, [SendPart(0, addr.rail(0), bytes(msg), op, trace=traced)], owner=owner,
            kind="send"))

    def submit_recvs(self, owner: Hashable, length: int, count: int,
                     deliver: Deliver, traced: bool = False) -> None:
        """Post receives for ``owner`` (a connection); see :mod:`.receives`.  ``traced``:
        ``deliver`` is also given each message's trace id (its sender's, or None)."""
        self.receives.post(owner, length, count, deliver, traced)

    def _deliver(self, peer: tuple[int, int], msg: bytes, ack: Callable[..., None],
                 source: Hashable = None, trace: bytes | None = None, op: int = 0) -> None:
        # From a Domain's worker: the receive side lives on the daemon's loop.
        self._notify(functools.partial(self.receives.arrive, peer, msg, ack, source, trace,
                                       op))

    def _sender_gone(self, source: Hashable) -> None:
        self._notify(functools.partial(self.receives.sender_gone, source))

    def session_drained(self, owner: Hashable) -> None:
        """``owner``'s write buffer is empty (the messages it was handed are out)."""
        self.receives.drained(owner)

    # -- receiver completion ---------------------------------------------------------

    def expect_imm_count(self, owner: Hashable, imm: int, count: int,
                         callback: Callable[[], None]) -> Callable[[], None]:
        """``callback`` runs on the daemon's loop once ``imm`` reaches ``count``.

        Returns the expectation's handle, for :meth:`cancel_expectation`.  It is in
        flight (inflight.py) until it fires, is cancelled or its connection goes.
        """
        value, inflight = _imm(imm) or 0, self.inflight
        # The handle by a weak reference: it holds ``fired`` (its callback), so a strong
        # one would make a cycle per expectation that only the collector frees (65,536
        # of a closing connection: a 2 s pass of it, every client waiting).
        cell: list[weakref.ref[Callable[[], None]]] = []

        def fired() -> None:
            h = cell[0]() if cell else None
            if h is not None:
                inflight.remove(h)
            callback()

        handle = self.expectations.expect(owner, value, count, fired)
        if not self.expectations.waiting(owner, handle):  # it fired at once
            return handle
        cell.append(weakref.ref(handle))
        counter = self.counter
        inflight.add(handle, "expectation", owner=owner, stage=Stage.EXPECTING,
                     progress=lambda: (min(counter.value(value), count), count),
                     what=f"imm {value} count {count}")
        return handle

    def expectations_pending(self) -> int:
        """Expectations clients wait on now (for the metrics)."""
        return self.expectations.pending()

    def cancel_expectation(self, owner: Hashable, handle: Callable[[], None]) -> bool:
        """Drop a waiting expectation (nothing consumed); False if it had fired."""
        if self.expectations.cancel(owner, handle):
            self.inflight.remove(handle)
            return True
        return False

    def cancel(self, fut: asyncio.Future[None], error: TransferdError) -> bool:
        """End a submit now with ``error`` (CANCELLED; TIMEOUT at its own deadline).

        Its parts not yet sent are never sent; parts already sent may still
        land and count at their destination (the outcome is unknown).  False
        when it had already finished.
        """
        if fut.done():
            return False
        if self.peer_slots is not None:
            if self.peer_slots.cancel(fut, error):  # waiting for a peer's slot: never sent
                return True
            fut = self.peer_slots.started(fut)
        entry = self._transfers.get(fut)
        if entry is not None:
            transfer, worker = entry
            # On the worker of the transfer's group, where its parts are sent from.
            worker.call(transfer.fail, error)
            return True
        if isinstance(fut, asyncio.Task):  # a write from device memory, still staging
            return fut.cancel()
        return False

    def imm_value(self, imm: int) -> int:
        return self.counter.value(_imm(imm) or 0)

    def session_closed(self, owner: Hashable) -> None:
        self.write_ids.closed(owner)
        self.peer_groups.closed(owner)
        for handle in self.expectations.of(owner):
            self.inflight.remove(handle)
        self.expectations.closed(owner)
        self.receives.closed(owner)

    # -- internals ---------------------------------------------------------------------

    def has_slot(self) -> bool:
        """Whether a submit would be taken now (else ``await wait_slot()`` first)."""
        return self.slots.has_slot()

    async def wait_slot(self) -> None:
        await self.slots.wait_slot()

    def _submit(self, op: int, parts: Sequence[WritePart | SendPart | ReadPart],
                held: Ref | None = None, group: DomainGroup | None = None,
                owner: Hashable = None, *, kind: str = "", span: Any = None
                ) -> asyncio.Future[None]:
        """Start a transfer on ``group``'s worker (default: the first group's) once its
        peers have a slot; ``held`` (the source's memory) goes when it finishes.  A peer
        at engine.max_inflight_per_peer makes it wait (peer_slots.py) without holding
        back anything else.  A traced write gets a span (transferd.tracing) where spans
        are on: ``kind`` names it; ``span``: one its caller started (and ends)."""
        assert self.peer_slots is not None
        keys = ((parts[0].dst.key,) if len(parts) == 1 else {p.dst.key for p in parts})
        inflight = self.inflight
        entry = inflight.get(op) if parts else None
        if entry is None and parts:
            p0 = parts[0]
            entry = inflight.add_transfer(
                op, _KINDS.get(type(p0), "send"), owner, parts,
                p0.trace, Stage.WAITING_PEER)
        elif entry is not None:  # a write from device memory, staged
            entry.plan = parts
            entry.move(Stage.WAITING_PEER, inflight.clock())
        spans, ends = None, False
        if parts and entry is not None and entry.trace is not None:
            spans = tracing.SPANS
            if spans is not None:
                if span is None:
                    span, ends = spans.transfer(kind, op, entry.trace), True
                spans.planned(span, parts)
        start = functools.partial(self._start_transfer, op, parts, group, entry)
        if span is not None:
            start = functools.partial(start, span=span)
        fut = self.peer_slots.run(keys, start, held.release if held is not None else None)
        if parts and fut not in self._transfers:
            # It waits for a peer's slot (or already ended): a started transfer's end
            # (_finished) forgets its entry itself, without a turn of the loop.
            fut.add_done_callback(lambda _: inflight.remove(op))
        if ends and spans is not None:
            fut.add_done_callback(functools.partial(spans.ended, span))
        return fut

    def _start_transfer(self, op: int, parts: Sequence[WritePart | SendPart | ReadPart],
                        group: DomainGroup | None, entry: Entry | None,
                        releases: tuple[Callable[[], None], ...] = (), *, span: Any = None
                        ) -> asyncio.Future[None]:
        """Hand parts to ``group``'s worker, taking a slot until the transfer ends;
        ``releases`` are called then too.  ``entry``: its in-flight entry (inflight.py);
        ``span``: the transfer's (tracing)."""
        assert self.groups and self.loop is not None
        group = group or self.groups[0]
        worker = self.workers[group.index]
        # Callers check has_slot() first; going over by one is harmless.
        slots = self.slots
        slots.take()
        loop = self.loop
        fut: asyncio.Future[None] = loop.create_future()
        if len(parts) == 1:
            nbytes = parts[0].nbytes if type(parts[0]) is WritePart else 0
        else:
            nbytes = sum(p.nbytes for p in parts if isinstance(p, WritePart))
        finished = self._finished

        # The slot and ``releases`` go in _finished, before the future's callbacks (each
        # done callback would be a turn of the loop of its own).
        if worker.on_daemon_loop:
            def finish(err: TransferdError | None) -> None:
                # On the daemon's loop already: no hand-off.
                finished(fut, err, nbytes, op, releases)
        else:
            def finish(err: TransferdError | None) -> None:
                loop.call_soon_threadsafe(finished, fut, err, nbytes, op, releases)

        transfer = Transfer(op, len(parts), nbytes, finish)
        if parts:
            transfer.trace = parts[0].trace
            transfer.span = span
        if entry is not None:
            entry.transfer = transfer
            entry.move(Stage.SENT, self.inflight.clock())
            if transfer.trace is not None and log.isEnabledFor(logging.DEBUG):
                log.debug("transfer %d: %d part(s), %d bytes to %s on rail(s) %s", op,
                          len(parts), nbytes, entry.peer, entry.rails,
                          extra=trace_fields(transfer.trace))
        self._transfers[fut] = (transfer, worker)
        try:
            worker.call(group.execute, transfer, parts)
        except TransferdError as exc:
            # A loop worker runs execute() here: what it refuses fails this transfer.
            transfer.fail(exc)
        return fut

    def when_finished(self, fut: asyncio.Future[None],
                      fn: Callable[[asyncio.Future[None]], None]) -> bool:
        """Call ``fn(fut)`` as ``fut`` ends, in :meth:`_finished` (a done callback would
        be a turn of the loop more per submit); False, nothing taken, unless ``fut`` is
        a started transfer's, which only _finished ends (not one waiting for a peer's
        slot, nor a task: a staged device write, a read)."""
        if (fut.done() or isinstance(fut, asyncio.Task) or fut not in self._transfers
                or fut in self._on_end):
            return False
        self._on_end[fut] = fn
        return True

    def _finished(self, fut: asyncio.Future[None], err: TransferdError | None,
                  nbytes: int, op: int, releases: tuple[Callable[[], None], ...]) -> None:
        """A transfer ended (once: Transfer calls its finish once): its slot, its peers'
        slots and its source's memory go, its in-flight entry too, then its future."""
        self.slots.release()
        for fn in releases:
            fn()
        self.inflight.remove(op)
        entry = self._transfers.pop(fut, None)
        if entry is not None and entry[0].trace is not None:
            # A traced transfer's end, for grep TRACEID (its start is logged too).
            log.log(logging.INFO if err is not None else logging.DEBUG,
                    "transfer %d %s%s", entry[0].op, "failed: " if err else "done",
                    err or "", extra=trace_fields(entry[0].trace))
        counted = self._counted
        if counted is not None:
            if err is None:
                counted[0] += 1
                counted[2] += nbytes
            else:
                counted[1] += 1
        end = self._on_end.pop(fut, None)
        if not fut.done():
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
        if end is not None:
            try:
                end(fut)
            except Exception:  # the caller's bug: never the link's or the transfer's
                log.exception("engine: a transfer's end handler failed")


# A submit's (verify, trace id) for its parts (TransferEngine._tag).
Tag = tuple[bool, bytes | None]
_UNTAGGED: Tag = (False, None)


def _verify_parts(length: int, tag: Tag) -> int | None:
    """How many parts a verified single write of ``length`` goes in (None: as planned):
    of VERIFY_PART bytes, but never more than a receiver takes for one write."""
    if not tag[0] or length <= VERIFY_PART:
        return None
    return min(-(-length // VERIFY_PART), MAX_PIECES)


def _wid(parts: Any, wid: int | None, tag: Tag = (False, None)) -> list[WritePart | SendPart]:
    """The planned parts, each carrying the write id (a retry plans the same parts), and
    the submit's verify and trace id."""
    out: list[WritePart | SendPart] = list(parts)
    verify, trace_id = tag
    if wid is not None or verify or trace_id is not None:
        for p in out:
            if isinstance(p, WritePart):
                p.wid = wid if wid is not None else p.wid
                p.verify, p.trace = verify, trace_id
    return out


def _imm(imm: int | None) -> int | None:
    # An inproc caller's is not the wire's checked field, and the peer wire packs it as
    # an unsigned int of 32 bits.
    return None if imm is None else unsigned(imm, "immediate", 0xFFFFFFFF)


T = TypeVar("T")


async def _call(fn: Callable[[], T]) -> T:
    return fn()
