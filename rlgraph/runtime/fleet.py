"""The fleet: everything a run starts on Ray, and the only module that talks to those actors.

- Ray itself (`rlgraph.runtime.cluster`: local on 127.0.0.1, or joined with ``--address``), checked
  against the plan before anything starts;
- the data plane (TransferQueue or the Ray object store), unless the caller passes a running one;
- one placement group per resource pool, one `GroupWorker` actor per rank of each worker group
  on its pool's bundles (colocated groups split a bundle), and the data source: in the process of
  TransferQueue's controller (``dataplane.host_source``, `rlgraph.runtime.dataplane.guest`) or an
  actor of its own.

The fleet starts, restarts, pings and closes them, submits op calls and waits for their results
with a timeout that says what it waited for, moves state columns between groups, and gathers or
loads every actor's state for checkpoints. It decides nothing: the scheduler says what to run,
the runner says when to restart or restore.

Actors are created with ``max_restarts=0``: restarting is the runner's job, because only it
knows what state to restore.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from rlgraph import heap
from rlgraph.errors import RLGraphError, StepTimeout
from rlgraph.graph.plan import Plan
from rlgraph.graph.settings import DataplaneSettings
from rlgraph.runtime.cluster import RayHandle, alive_nodes, check_cluster, check_lost_nodes, start_ray
from rlgraph.runtime.dataplane.errors import DataPlaneDied, dead_actors
from rlgraph.runtime.scheduler import Call, StepScheduler, row_homes

__all__ = ["Fleet", "PLANE", "SOURCE"]

SOURCE = "source"  # the data source's name in `dead()` and in checkpoint states
CONTROL = "control"  # the worker actors' concurrency group for imports during a call
PLANE = "data plane"  # the data plane's name among the dead (`rlgraph.runtime.runner`)
WATCH_S = 1.0  # a wait asks this often whether a data-plane actor died
CHECK_POLL_S = 0.1  # and this often whether the start's checks failed, while they run
SAY_WAIT_S = 10.0  # a wait longer than this is logged, with what it waits for
WORKER_CLOSE_S = 15.0  # closing waits this long for the workers to close their worker classes
PG_REMOVE_S = 5.0  # closing waits this long for Ray to remove the placement groups
GUEST_STOP_S = 5.0  # closing waits this long for the data plane to let go of a hosted source
FORGET_BATCH = 4  # cleared partitions a worker is told of with its next call; at this many, on their own
log = logging.getLogger("rlgraph.runtime")


RAY_STRATEGY = {"pack": "PACK", "spread": "SPREAD", "strict_spread": "STRICT_SPREAD"}  # pool placement -> Ray's


class Fleet:
    """Ray, the data plane, the worker actors and the source of one run. Use as a context manager."""

    def __init__(self, plan: Plan, timeout_s: float, dataplane: str | None = None, address: str | None = None,
                 plane: Any = None, on_ray_started: Any = None, verbose: bool = False,
                 on_phase: Callable[[str], None] | None = None, inject_faults: bool = False,
                 ray_handle: RayHandle | None = None, checks: Callable[[], None] | None = None) -> None:
        """`plane`: an already started data plane to use (and leave running), e.g. a test session's.
        `on_phase` is told, in a line each, when a start-up phase is done and how long it took.
        `inject_faults`: start workers that take the runner's fault-injection hook (tests).
        `ray_handle`: a Ray the caller started for this run (used, and stopped at the end).
        `checks`: called once, when the first workers' actors are created and before the fleet waits
        for them (the CLI's preflight, run beside their start); what it raises stops the start."""
        self._checks = checks
        self._inject_faults = inject_faults
        self._on_phase = on_phase or (lambda message: None)
        self.plan = plan
        self.timeout_s = timeout_s
        self._plan_json = plan.model_dump_json()
        self.dataplane_settings = DataplaneSettings.of(plan)
        self._backend = dataplane or self.dataplane_settings.backend
        self._address = address
        self._on_ray_started = on_ray_started
        self._verbose = verbose
        self._own_plane = plane is None
        self.plane: Any = plane
        self.ray: RayHandle | None = None
        self._ray_given = ray_handle
        self.workers: dict[str, list[Any]] = {}
        self.source: Any = None  # an actor handle, or `Hosted` (in the data plane's controller)
        self._source_hosted = False
        self._source_token = ""  # names the hosted source's start (`guest.GuestHost.guest_stop`)
        self.stateful: dict[str, bool] = {}  # group -> keeps state beyond a call (restore it, not just restart)
        self.initial_source_state: Any = None
        self._pgs: dict[str, Any] = {}  # pool -> placement group
        self._plane_job: concurrent.futures.Future | None = None  # the data plane starting beside the workers
        self._checking: concurrent.futures.Future | None = None  # the caller's `checks`, beside the workers' start
        self._starter: concurrent.futures.ThreadPoolExecutor | None = None  # runs `_plane_job` and `_checking`
        self._read_ahead: dict[str, tuple[str, ...]] | None = None  # op -> columns (`read_ahead`), made once
        self._ahead_pending: dict[str, list[tuple[str, str, tuple[int, ...], tuple[str, ...]]]] = {}  # group -> reads
        self._ahead_refs: list[Any] = []  # the read-aheads sent whose results were not read yet
        # (group, rank), or SOURCE -> partitions cleared since its last call: sent with its next (`clear`)
        self._forget_pending: dict[Any, list[str]] = {}
        self._parts_readers: dict[str, bool] = {}  # streaming op -> whether its parts are sent as they come
        self.node_of: dict[tuple[str, int], str] = {}  # (group, rank) -> the Ray node id it runs on
        self.started = False  # start() finished: every worker set up (only then may close() wait for them)
        self.nodes: dict[str, dict[str, float]] = {}  # Ray node id -> resources, at start

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.close(graceful=False)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(graceful=exc_type is None)

    def start(self) -> None:
        t0 = time.time()
        self.ray, self._ray_given = self._ray_given or start_ray(self.plan, self._address, self._verbose), None
        if self.ray.seconds:
            t0 -= self.ray.seconds  # started before the fleet, beside the imports
        if self._on_ray_started:
            self._on_ray_started()
        # before any actor: fail with a list, never hang; the nodes as the run found them (a restart
        # checks for lost ones)
        self.nodes = check_cluster(self.plan)
        cpus = sum(n.get("CPU", 0.0) for n in self.nodes.values())
        how = ("joined " + self._address if self._address else "started on 127.0.0.1") if self.ray.started_here \
            else "already running"
        self._on_phase(f"Ray: {how}, {len(self.nodes)} node(s), {cpus:g} CPUs ({time.time() - t0:.1f}s)")
        # the data plane starts on a thread while the workers start and load their models; they connect
        # to it once both are up (its actors' CPUs are reserved by the plan beside the pools')
        self._starter = None
        try:
            self._start_workers()
        finally:
            if self._starter is not None:
                self._starter.shutdown(wait=True)  # on a failure too: close() then stops what it started
                self._starter = None
            self._checking = None
        self.started = True
        heap.freeze()  # the driver's imports, plan and handles: out of the collector's full collections

    def _start_workers(self) -> None:
        """Placement groups, the worker actors and the source; their models loaded; connected to the
        data plane (started beside them by `start`, or given)."""
        import ray
        from ray.util.placement_group import placement_group

        t0 = time.time()
        for pool in self.plan.pools:
            bundles = [{"CPU": max(b.num_cpus, 0.01), **({"GPU": b.num_gpus} if b.num_gpus else {})}
                       for b in pool.bundles]
            strategy = RAY_STRATEGY[pool.placement]  # PACK and SPREAD are best effort, STRICT_SPREAD is not
            self._pgs[pool.name] = placement_group(bundles, strategy=strategy, name=f"rlgraph-{pool.name}")
        # the actors are submitted at once (Ray places them when their group is ready), then the plane's
        # start and the caller's checks on threads: this process's imports (torch for the plane, the
        # tokenizer for the checks) would otherwise hold back the submissions, and the workers' setup
        # (`_submit_setups`) would wait for the checks. A failed check is raised by the wait it fails
        # during (`_watched_wait` asks every `CHECK_POLL_S` while it runs), and the workers count as
        # started only once the checks are done
        own_plane = self.plane is None
        handle = None if own_plane else self.plane.handle()  # None: they connect once the plane is up
        for g in self.plan.groups:
            self._create_group(g.name, handle)
        if not own_plane or not self._hosts_source():  # else the plane's start makes it
            self._create_source(handle)
        checks, self._checks = self._checks, None
        if own_plane or checks is not None:
            self._starter = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rlgraph_start")
        if own_plane:
            self._plane_job = self._starter.submit(self._timed_plane_start)
        if checks is not None:  # a failure stops the start (close)
            self._checking = self._starter.submit(checks)
        for pool, pg in self._pgs.items():
            try:
                ray.get(pg.ready(), timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise StepTimeout(f"placement group for pool {pool!r} was not ready after {self.timeout_s:g}s; "
                                  f"Ray's free resources now: {ray.available_resources()}") from None
        names = list(self.workers)
        meet = self._rendezvous(names)
        setups = self._submit_setups(names, meet)  # not held back by the checks: the workers load meanwhile
        checking, self._checking = self._checking, None
        if checking is not None:  # done before the workers count as started
            checking.result()  # its own imports and reads only: no wait of its own to bound
        actors = sum(len(ws) for ws in self.workers.values())
        where = "in the data plane's controller" if self._hosts_source() else "on its own"
        self._on_phase(f"workers: {actors} actor(s) in {len(names)} group(s) on {len(self._pgs)} pool(s), the "
                       f"data source {where} ({time.time() - t0:.1f}s)")
        t0 = time.time()
        if self._plane_job is not None:  # the workers connect (on their control thread) while they load models
            self._plane_job.result(timeout=self.timeout_s + 180)  # its own waits have timeouts; this is a backstop
            self._plane_job = None
            handle = self.plane.handle()
            connects = [w.connect.options(concurrency_group=CONTROL).remote(handle)
                        for ws in self.workers.values() for w in ws]
            connects += [] if self._source_hosted else [self.source.connect.remote(handle)]
            self.get(connects, "the workers to connect to the data plane")
            self._on_phase(f"connected {len(connects)} actor(s) to the data plane ({time.time() - t0:.1f}s after "
                           f"they started)")
        self._setups_done(setups)
        self._on_phase(f"model load: op imports and worker setup, models included ({time.time() - t0:.1f}s)")
        self.initial_source_state = self.get([self.source.state_dict.remote()], "the data source to start")[0]
        has_state = self.get([self.workers[g][0].has_instance_state.remote() for g in names], "worker state inventory")
        state_ops = self.plan.state_ops()
        for g, inst in zip(names, has_state):
            self.stateful[g] = bool(inst) or any(o in state_ops for o in self.plan.group(g).ops)

    def _timed_plane_start(self) -> None:
        t0 = time.time()
        self.plane = self._start_dataplane()
        if self._hosts_source():  # its imports and set-up beside the workers' start
            self._create_source(self.plane.handle())
        units = self._storage_units()
        kind = "Ray object store" if self._backend == "ray" else (
            f"TransferQueue, {units} storage unit(s)"
            + (" in its controller's process" if self.plane.config.unit_hosted else "")
            + (", large columns through shared memory" if self.plane.uses_shared_memory() else ""))
        self._on_phase(f"data plane: {kind} ({time.time() - t0:.1f}s, beside the workers' start)")

    def _start_dataplane(self) -> Any:
        from rlgraph.runtime.dataplane import RayObjectStoreDataPlane, TransferQueueConfig, TransferQueueDataPlane

        if self._backend == "ray":
            return RayObjectStoreDataPlane.start(op_timeout_s=self.timeout_s)
        return TransferQueueDataPlane.start(TransferQueueConfig(
            num_storage_units=self._storage_units(), op_timeout_s=self.timeout_s,
            shared_memory=self.dataplane_settings.shared_memory, host_unit=self.dataplane_settings.host_unit))

    def _storage_units(self) -> int:
        units = self.dataplane_settings.storage_units
        assert units is not None, "the compiler resolves dataplane.storage_units (one per node) into every plan"
        return units

    def _create_group(self, name: str, handle: Any) -> None:
        """Start the actors of worker group `name` (not yet set up) on its pool's bundles, connected
        to the data plane through `handle` (None: they connect later)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlgraph.runtime.actor import READ_AHEAD, actor_class

        g = self.plan.group(name)
        share = sum(1 for x in self.plan.groups if x.pool == g.pool)  # colocated groups time-share bundles
        bundle = next(p for p in self.plan.pools if p.name == g.pool).bundles
        self.workers[name] = [
            # CONTROL: a second thread, for state imports that must not wait for the running call;
            # READ_AHEAD: a third, for reads ahead of a call (`GroupWorker.read_ahead`)
            ray.remote(concurrency_groups={CONTROL: 1, READ_AHEAD: 1})(
                actor_class("FaultInjectingWorker" if self._inject_faults else "GroupWorker")).options(
                num_cpus=max(bundle[r].num_cpus, 0.01) / share,
                num_gpus=bundle[r].num_gpus / share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pgs[g.pool], placement_group_bundle_index=r),
                max_restarts=0,  # restarts are the runner's: it restores state and re-runs the work
            ).remote(self._plan_json, name, r, g.dp, handle)
            for r in range(g.dp)
        ]

    def _hosts_source(self) -> bool:
        """Whether the data source runs in the data plane's controller (TransferQueue's; the Ray
        store's plane has no such process)."""
        if not self.dataplane_settings.host_source:
            return False
        if self.plane is not None:
            return self.plane.guest_host() is not None
        return self._backend == "transferqueue"  # the plane this fleet is starting

    def _create_source(self, handle: Any) -> None:
        """Start the data source, connected to the data plane through `handle` (None: later)."""
        import ray

        from rlgraph.runtime.dataplane.guest import Hosted
        from rlgraph.runtime.source import SourceWorker

        self._forget_pending.pop(SOURCE, None)  # a new source knows nothing of them
        host = self.plane.guest_host() if self.plane is not None and self.dataplane_settings.host_source else None
        if host is not None:  # one process less to start (rlgraph.runtime.dataplane.guest)
            import uuid

            self._source_token = uuid.uuid4().hex
            host.guest_start.remote(f"{SourceWorker.__module__}:{SourceWorker.__name__}",
                                    (self._plan_json, handle, False), "data source", self.timeout_s, self._source_token)
            self.source, self._source_hosted = Hosted(host), True
            return
        self.source = ray.remote(SourceWorker).options(num_cpus=0).remote(self._plan_json, handle)
        self._source_hosted = False

    @property
    def source_actor(self) -> Any:
        """The Ray actor the data source runs in: its own, or, hosted, the data plane's controller."""
        return self.source.actor if self._source_hosted else self.source

    def _stop_source(self) -> None:
        """Kill the source's actor; a hosted source is closed and let go of by its host (the plane's
        controller), waited for a few seconds at most."""
        import ray

        if self.source is None:
            return
        if self._source_hosted:
            try:
                ray.get(self.source.actor.guest_stop.remote(self._source_token), timeout=GUEST_STOP_S)
            except Exception:  # the host died with its plane, or does not answer: it goes with the plane
                pass
        else:
            ray.kill(self.source, no_restart=True)

    def _rendezvous(self, names: list[str]) -> list[Any]:
        """Rank 0's address of each group in `names` (once its actors have started): every rank of
        a group meets there (torch.distributed for DDP/DeepSpeed)."""
        return self.get([self.workers[g][0].rendezvous.remote() for g in names], "worker actors to start")

    def _setup_groups(self, names: list[str], meet: list[Any] | None = None) -> None:
        meet = self._rendezvous(names) if meet is None else meet
        self._setups_done(self._submit_setups(names, meet))

    def _submit_setups(self, names: list[str], meet: list[Any]) -> list[tuple[tuple[str, int], Any]]:
        ranks = [(g, r) for g in names for r in range(len(self.workers[g]))]
        return [((g, r), self.workers[g][r].setup.remote(*meet[names.index(g)])) for g, r in ranks]

    def _setups_done(self, setups: list[tuple[tuple[str, int], Any]]) -> None:
        nodes = self.get([ref for _, ref in setups], "worker start-up (op imports, worker classes' setup: model loading)")
        self.node_of.update(zip([rank for rank, _ in setups], nodes))

    def placement(self) -> dict[str, Any]:
        """Where the workers run: the cluster's nodes (Ray node ids, head first, then in Ray's order)
        and each group's ranks as indexes into them. Written to the run directory as placement.json."""
        head = "node:__internal_head__"  # a resource only Ray's head node has
        alive = sorted(alive_nodes().items(), key=lambda item: not item[1].get(head))
        index = {node: i for i, (node, _) in enumerate(alive)}
        groups: dict[str, list[int | None]] = {}
        for (g, r), node in sorted(self.node_of.items()):
            groups.setdefault(g, []).append(index.get(node))
        return {"nodes": [{"id": node, "head": bool(res.get(head)), "cpus": res.get("CPU", 0.0),
                           "gpus": res.get("GPU", 0.0)} for node, res in alive],
                "groups": groups,
                "pools": {p.name: p.placement for p in self.plan.pools}}

    def restart(self, groups: Iterable[str]) -> int:
        """Kill every actor of `groups` (all ranks: they share a process group) and start them again
        on the same bundles; their state is what setup gives. Returns the number of actors started."""
        import ray

        names = sorted(set(groups))
        check_lost_nodes(self.plan, self.nodes)  # NodeLost when the nodes left cannot hold the plan
        for g in names:
            for r, w in enumerate(self.workers[g]):
                ray.kill(w, no_restart=True)
                self._forget_pending.pop((g, r), None)  # a new process keeps nothing of them
            self._create_group(g, self.plane.handle())
        if names:
            self._setup_groups(names)
        return sum(len(self.workers[g]) for g in names)

    def plane_dead(self) -> list[str]:
        """The data-plane actors that died (by name; [] while all live)."""
        return dead_actors(self.plane.actors()) if self.plane is not None else []

    def restart_plane(self) -> int:
        """Replace a data plane that lost an actor with a new one, and restart every worker group
        and the source on it (their clients, and calls blocked on the dead actor, go with their
        processes). Their state is what setup gives; the runner restores it. Returns the actors
        started (the plane's own not counted)."""
        import ray

        dead = self.plane_dead()
        if not self._own_plane:
            raise DataPlaneDied(dead or ["(unknown)"], "it was given to this run, which cannot restart it")
        check_lost_nodes(self.plan, self.nodes)
        old, self.plane = self.plane, None
        for handle in old.actors().values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already dead
                pass
        old.close()
        self.plane = self._start_dataplane()
        return self._replace_source() + self.restart(list(self.workers))

    def restart_source(self) -> int:
        """Kill the data-source actor and start it again; returns the actors started. A hosted
        source that died or stopped answering is a lost data plane: only ending its host ends a
        call of it that hangs, so the plane is replaced (`restart_plane`)."""
        return self.restart_plane() if self._source_hosted else self._replace_source()

    def _replace_source(self) -> int:
        """Let go of the source and start a new one on the current plane; returns 1."""
        self._stop_source()
        self._create_source(self.plane.handle())
        return 1

    def dead(self) -> set[str]:
        """Groups with an actor that no longer answers, plus `SOURCE` if the data source died."""
        import ray

        refs = {(SOURCE, 0): self.source.state_dict.remote()}
        for g, ws in self.workers.items():
            for r, w in enumerate(ws):
                refs[(g, r)] = w.ping.remote()
        dead = set()
        for (g, _), ref in refs.items():
            try:
                ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.add(g)
        return dead

    @staticmethod
    def _close_workers(workers: list[Any]) -> None:
        """Let each worker close its worker classes (`GroupWorker.close`: a vLLM engine shuts its processes
        down and removes its shared memory, which a kill leaves behind) before it is killed. A worker still
        in a call closes after it; one that is dead, fails or takes longer than `WORKER_CLOSE_S` is killed
        as it is."""
        import ray

        if not workers:
            return
        refs = [w.close.remote() for w in workers]
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=WORKER_CLOSE_S)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # a dead actor, or a close that raised: it is killed next
                log.debug("a worker did not close: %s", e)
        if pending:
            log.warning("%d worker(s) did not close within %.0fs (a call still running?); killing them as they are",
                        len(pending), WORKER_CLOSE_S)

    def close(self, graceful: bool = True) -> None:
        """Stop what this run started: actors, placement groups, the data plane, Ray (if ours). `graceful`
        (a run that ended, not one that failed or was interrupted, whose calls may still be running),
        once `start` has finished: the workers close their worker classes first (`_close_workers`). An
        interrupt during that wait (Ctrl-C) ends the wait, not the rest: everything is stopped, then the
        interrupt is raised."""
        try:
            import ray
        except ImportError:  # pragma: no cover
            return
        interrupted: BaseException | None = None
        if ray.is_initialized():
            workers = [w for ws in self.workers.values() for w in ws]
            if graceful and self.started:
                try:
                    self._close_workers(workers)
                except BaseException as e:  # noqa: BLE001 - an interrupt: stop everything first, then raise it
                    interrupted = e
            for w in workers:
                ray.kill(w, no_restart=True)
            self._stop_source()
            from ray.util.placement_group import remove_placement_group

            def remove_all(pgs: list) -> None:
                for pg in pgs:
                    try:
                        remove_placement_group(pg)
                    except Exception:  # already gone with a dead cluster
                        pass
            # with the local raylet gone (a kill of the run's process group) the call never returns:
            # give it a few seconds on a thread of its own, then go on closing
            t = threading.Thread(target=remove_all, args=(list(self._pgs.values()),), name="rlgraph_remove_pgs",
                                 daemon=True)
            t.start()
            t.join(PG_REMOVE_S)
        self.workers, self.source, self._pgs = {}, None, {}
        if self.plane is not None and self._own_plane:
            self.plane.close()
        self.plane = None
        if self.ray is not None:
            self.ray.shutdown()
            self.ray = None
        self.started = False
        if interrupted is not None:
            raise interrupted

    # ------------------------------------------------------------------ calls and waits
    def get(self, refs: list[Any], what: str) -> list[Any]:
        """Results of `refs`, waiting at most the run's timeout; an rlgraph error raised in an actor
        comes out as itself, a timeout as `StepTimeout` naming `what`."""
        import ray

        try:
            ready, _ = self._watched_wait(refs, len(refs), what)
            if len(ready) < len(refs):
                raise StepTimeout(f"timed out after {self.timeout_s:g}s waiting for {what}")
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), RLGraphError) else None
            if cause is not None:
                raise cause from None
            raise

    def submit(self, call: Call, step: int, partition: str, uids: list[int], tags: tuple[bool, ...],
               batch_inputs: Mapping[str, Any], fault: tuple[str, str] | None, salt: int = 0) -> Any:
        """Start `call` on its rank; returns what to wait on: an object reference, or for a streaming
        op a Ray streaming generator that delivers each part's result, then the call's. `salt`: the
        refill round (dynamic sampling), so that each round's calls get seeds of their own. `fault`:
        (kind, op) of an injected fault (tests), the op being the call's own or one fused into it."""
        c = call.chunk
        worker = self.workers[call.group][call.rank]
        # only a FaultInjectingWorker takes these
        hook: dict[str, Any] = {"fault": fault[0], "fault_op": fault[1]} if fault else {}
        if call.fused:  # the ops fused into the call (`rlgraph.graph.fuse`), each with its chunks' (index, rows)
            hook["fused"] = [(name, [(ch.index, len(ch.rows)) for ch in chunks]) for name, chunks in call.fused]
        if call.after:  # queued behind the step before's call: the worker checks that it ended well first
            hook["after"] = call.after
        rows, row_uids = list(call.rows), [uids[i] for i in call.rows]
        # where the rows are in the data plane: the worker's gets and puts then ask the plane nothing first.
        # They name storage slots, not partitions, so no call of a step may run after its partition is
        # cleared and its slots reused: a recovery restores every worker (which waits for their calls)
        # before it creates a partition again
        hook["addresses"] = self.plane.addresses(partition, rows)
        forget = self._forget_later((call.group, call.rank))
        if forget:
            hook["forget"] = forget
        if self.plan.op(c.op).streams:
            args = (c.op, step, partition, c.index, rows, row_uids, list(tags), dict(batch_inputs), salt)
            if not self._parts_read_elsewhere(c.op):
                ref = worker.run_chunk_whole.remote(*args, **hook)
            else:
                ref = worker.run_chunk_stream.options(num_returns="streaming").remote(*args, **hook)
        else:
            ref = worker.run_chunk.remote(c.op, step, partition, call.spans, rows, row_uids, list(tags),
                                          dict(batch_inputs), salt, **hook)
        if call.rank == 0 and call.group in self._ahead_pending:  # after the call: its start is not held up by them
            self._send_read_aheads(call.group, c.op, partition)
        return ref

    def _parts_read_elsewhere(self, op: str) -> bool:
        """Whether another op may start on a streaming `op`'s rows while its call still runs: an op
        outside its fused chain, on another group, reads what it writes; or its group has several
        ranks (one may be free while another generates). Else its calls return once, whole
        (`GroupWorker.run_chunk_whole`): the ops of its own group that read it (the update) wait for
        this worker's call to end anyway."""
        known = self._parts_readers.get(op)
        if known is None:
            o = self.plan.op(op)
            writes = set(o.outputs)
            known = self._parts_readers[op] = self.plan.group(o.group).dp > 1 or any(
                r.group != o.group and r.fused_into != op and writes.intersection(r.inputs)
                for r in self.plan.ops if r.name != op)
        return known

    def wait(self, waitables: list[Any], what: Any = "op calls and weight syncs") -> list[Any]:
        """Those of `waitables` with a result ready (a finished call, a streaming call's next part),
        waiting up to the timeout for the first one. `what`: a text, or a callable giving one,
        for the log line of a long wait."""
        done, _ = self._watched_wait(waitables, 1, what)
        return done

    def _watched_wait(self, waitables: list[Any], num: int, what: Any) -> tuple[list[Any], list[Any]]:
        """``ray.wait`` for `num` of `waitables` up to the run's timeout, asking every `WATCH_S`
        whether a data-plane actor died (`DataPlaneDied`: a call blocked on it would wait its own
        timeout, minutes, and a dead plane answers nothing), and during the start every
        `CHECK_POLL_S` whether the caller's checks failed (their error, raised at once). A wait
        longer than `SAY_WAIT_S` is logged once, naming what it waits for."""
        import ray

        start = time.monotonic()
        deadline, said, watch = start + self.timeout_s, False, start + WATCH_S
        while True:
            left = deadline - time.monotonic()
            poll = WATCH_S if self._checking is None else CHECK_POLL_S
            ready, rest = ray.wait(waitables, num_returns=num, timeout=max(0.0, min(poll, left)))
            checking = self._checking  # the start's checks (`_start_workers`): a failure ends the start now
            if checking is not None and checking.done() and checking.exception() is not None:
                raise checking.exception()  # type: ignore[misc]
            if len(ready) >= num or left <= poll:
                return ready, rest
            if time.monotonic() >= watch:
                watch = time.monotonic() + WATCH_S
                dead = self.plane_dead()
                if dead:
                    raise DataPlaneDied(dead, f"waiting for {what() if callable(what) else what}")
            if not said and time.monotonic() - start > SAY_WAIT_S:
                said = True
                log.info("still waiting after %.0fs (timeout %gs) for %s", time.monotonic() - start, self.timeout_s,
                         what() if callable(what) else what)

    def result(self, waitable: Any, what: str) -> Any:
        """The ready result of a waitable `wait` returned: a call's `CallResult`, or a streaming
        call's next `PartResult` (its last result is the `CallResult`)."""
        import ray

        if isinstance(waitable, ray.ObjectRefGenerator):
            waitable = next(waitable)
        return self.get([waitable], what)[0]

    def homes(self, rows: int) -> tuple[list[int] | None, list[str] | None]:
        """Each row's storage unit and that unit's node (`scheduler.row_homes`), or None and None:
        TransferQueue's own rule (``dataplane.locality=hash``, or a plane that places rows by writer)."""
        if self.dataplane_settings.locality != "node":
            return None, None
        units = self.plane.storage_nodes()
        homes = row_homes(self.plan, rows, self.node_of, units)
        return (None, None) if homes is None else (homes, [units[h] for h in homes])

    def fence(self) -> None:
        """Wait until every call sent so far has ended on every live worker and the source.

        Each of them runs its calls one at a time, in order, so a ping sent now is answered after
        them. The driver fences before it clears the partitions of a failed step, whose other calls
        may still run: such a call must not read a shared-memory segment that its writer reuses
        once the partition is forgotten, nor put into row indexes TransferQueue gives the step's
        retry. A dead actor runs nothing (it answers with an error), and the wait is bounded by the
        run's timeout; the recovery that follows restarts what is dead."""
        import ray

        refs = [w.ping.remote() for ws in self.workers.values() for w in ws]
        if self.source is not None:
            refs.append(self.source.ping.remote())
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)

    def clear_failed(self, partitions: list[str], error: BaseException) -> None:
        """Clear the partitions of steps that failed with `error`; unless the run ends on it (a step
        timeout), after their other calls have ended (`fence`)."""
        if partitions and not isinstance(error, StepTimeout):
            self.fence()
        for partition in partitions:
            self.clear(partition)

    def clear(self, partition: str) -> None:
        """Clear `partition` from the data plane, and have every worker drop what it kept of it in
        memory (`rlgraph.runtime.dataplane.local`), and the source what it knows of its rows. That
        is sent with each one's next call (`submit`, `produce`): Ray runs an actor's calls in
        order, so a call of its own would run between the worker's two calls, on the step's path.
        One that gets no call while `FORGET_BATCH` partitions wait is sent them on their own."""
        for pending in self._ahead_pending.values():  # reads planned for it that were not sent yet
            pending[:] = [p for p in pending if p[1] != partition]
        try:
            self.plane.clear(partition)
        finally:
            owners = [((g, r), w) for g, ws in self.workers.items() for r, w in enumerate(ws)]
            for key, w in owners + ([(SOURCE, self.source)] if self.source else []):
                pending = self._forget_pending.setdefault(key, [])
                pending.append(partition)
                if len(pending) >= FORGET_BATCH:
                    self._forget_now(key, w)

    def clear_all(self, partitions: list[str]) -> None:
        """`clear` each of `partitions` in turn, taking it off the list (what is left, should one fail,
        is what a failure's `clear_failed` still clears)."""
        while partitions:
            self.clear(partitions[0])
            partitions.pop(0)

    def _forget_now(self, key: Any, worker: Any) -> None:
        for partition in self._forget_pending.pop(key, []):
            try:
                worker.forget.remote(partition)
            except Exception:  # a dead actor: its memory went with it
                pass

    def _forget_later(self, key: Any) -> list[str]:
        """The partitions to send with `key`'s next call (`clear`)."""
        return self._forget_pending.pop(key, [])

    def read_ahead(self, partition: str, sched: StepScheduler, ops: set[str] | None) -> None:
        """Plan reads ahead for the step just admitted (`sched`; `ops`: its ops, None: all): the
        worker of each op that reads only the source's columns (`actor.read_ahead_ops`) is to read
        them for the op's call while it runs the call before it. The read is sent with the next call
        this fleet sends that worker (`submit`): in a synchronous step the update, which generation
        then waits for; sent at once, it would share the worker with the generation still running.
        A worker whose group is sent no call but the op's own (the update closing generation's
        fused chain, `rlgraph.graph.fuse`) reads for itself: sent beside the step before's call, the
        read slowed that call's generation by ~4 ms on 16 x 8, more than its 2.2 ms get.
        Only where the rank is known now (a group of one rank, `StepScheduler.single_rank_rows`);
        nothing is waited for."""
        if self._read_ahead is None:
            from rlgraph.runtime.actor import read_ahead_ops

            self._read_ahead = read_ahead_ops(self.plan)
        for op, columns in self._read_ahead.items():
            rows = sched.single_rank_rows(op) if ops is None or op in ops else None
            if rows:
                self._ahead_pending.setdefault(self.plan.op(op).group, []).append((op, partition, rows, columns))

    def _send_read_aheads(self, group: str, op: str, partition: str) -> None:
        """Before a call of `op` on `partition` to rank 0 of `group`: the reads ahead planned for that
        worker, but the one for this very call (it reads for itself)."""
        import ray

        from rlgraph.runtime.actor import READ_AHEAD

        pending = self._ahead_pending.pop(group, None)
        if not pending:
            return
        if self._ahead_refs:  # the earlier ones' results (None, or a dead worker's error): read, so Ray logs none
            done, self._ahead_refs = ray.wait(self._ahead_refs, num_returns=len(self._ahead_refs), timeout=0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead worker: its call fails and recovery restarts it
                    pass
        worker = self.workers[group][0]
        for ahead_op, ahead_partition, rows, columns in pending:
            if (ahead_op, ahead_partition) == (op, partition):
                continue
            self._ahead_refs.append(worker.read_ahead.options(concurrency_group=READ_AHEAD).remote(
                ahead_partition, list(rows), list(columns), self.plane.addresses(ahead_partition, rows)))

    def produce(self, partition: str, rows: int, uid_start: int, validation: bool) -> Any:
        """Have the source write a step's first columns; returns what to wait on (`result` gives the
        rows' group ids, padding tags and the source's metrics of the batch)."""
        where = self.plane.addresses(partition, range(rows))
        return self.source.produce.remote(partition, rows, uid_start, validation, where, self._forget_later(SOURCE))

    def assemble(self, partition: str, picks: list[tuple[str, list[int]]], columns: list[str], padding: int,
                 pad_uid_start: int) -> None:
        """Have the source write a refilled batch: the rows `picks` names (round partition, rows) with
        `columns`, then `padding` padding rows; the payload moves between workers, not the driver."""
        self.get([self.source.assemble.remote(partition, picks, columns, padding, pad_uid_start)],
                 f"the data source to assemble the training batch {partition!r} from the rounds")

    # ------------------------------------------------------------------ state
    def export_state(self, group: str, column: str) -> Any:
        """A reference to state column `column` as rank 0 of `group` holds it once its calls so far
        are done (Ray runs an actor's calls in order); the value never passes through the driver."""
        return self.workers[group][0].export_state.remote(column)

    def import_state(self, group: str, column: str, ref: Any, now: bool = False) -> list[Any]:
        """Give the ranks of `group` the state column value `ref` (every rank, or ranks 1.. of the
        group that wrote it: rank 0's value is the one all read); returns the calls to wait on.
        `now`: on the workers' control thread, while a call may be running (partial rollout; the
        running call sees the value through ``ctx.state``), instead of after their calls so far."""
        first = 1 if self.plan.op(self.plan.columns[column].producer).group == group else 0
        calls = []
        for w in self.workers[group][first:]:
            method = w.import_state.options(concurrency_group=CONTROL) if now else w.import_state
            calls.append(method.remote(column, ref))
        return calls

    def state_names(self) -> list[str]:
        """The names of the states a checkpoint holds: ``<group>_<rank>`` per worker, and the source."""
        return [f"{g}_{r}" for g, ws in self.workers.items() for r in range(len(ws))] + [SOURCE]

    def states(self) -> dict[str, Any]:
        """Every actor's state, by `state_names`: state columns and worker-class ``state_dict``\\ s."""
        out: dict[str, Any] = {}
        for g, ws in self.workers.items():
            for r, w in enumerate(ws):
                cols, inst = self.get([w.state_columns.remote(), w.instance_states.remote()],
                                      f"checkpoint state of {g}[{r}]")
                out[f"{g}_{r}"] = {"columns": cols, "instances": inst}
        out[SOURCE] = self.get([self.source.state_dict.remote()], "the data source's position")[0]
        return out

    def load_states(self, states: Mapping[str, Any], what: str) -> None:
        """Load `states` (as `states` returns them) into the actors."""
        calls = []
        for g, ws in self.workers.items():
            for r, w in enumerate(ws):
                st = states[f"{g}_{r}"]
                calls += [w.load_state_columns.remote(st["columns"]), w.load_instance_states.remote(st["instances"])]
        calls.append(self.source.load_state_dict.remote(states[SOURCE]))
        self.get(calls, what)

    def rewind_source(self) -> None:
        """Put the data source back where it started (a restore with no checkpoint)."""
        self.get([self.source.load_state_dict.remote(self.initial_source_state)], "the data source to rewind")
