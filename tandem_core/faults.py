"""A fault at any await: a TEST AID, off by default, never set in a deployment.

`hit(site)` sits before a named await (a Redis command, the gRPC KV pull, an engine call); when the
plan says so, the N-th call at that site raises instead of going on. Tests use it to show that every
failure path ends a request cleanly (docs/reliability.md, "Faults at an await").

The plan comes from `configure(spec)` (tests in one process) or, read once at the first `hit`,
the environment variable `TANDEM_FAULTS` (a test's subprocesses). Spec: comma-separated
`site@calls[:kind]`, where `calls` is `N` (the N-th call, 1-based), `N-M`, or `N+` (the N-th and
every later one), and `kind` is `error` (default: `InjectedFault`, an error nothing retries) or
`down` (redis-py's ConnectionError: Redis looks down, so the retry paths run), or `sleepMS` (the
call waits MS milliseconds, then goes on: a slow site, e.g. a decode step slowed so a test's kill
lands mid-stream however fast the machine decodes). Example:
`TANDEM_FAULTS=decode.own@2,decode.publish@3-40:down,decode.step@1+:sleep20`.

A fault that ends a process (an engine call failing kills the decode pod's engine thread: the pod
hands its requests back and exits, its supervisor restarts it) would fire again in every restart,
whose call counts start at 0. With `TANDEM_FAULTS_STATE` set to a directory shared by the processes,
each planned call (`site@N`) raises once in the whole cluster: the first process to reach it leaves
a file there, and later lives of the same pod go on.

Off (no spec), `hit` is one dict lookup: it may sit on per-step paths.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger(__name__)
ENV = "TANDEM_FAULTS"
STATE_ENV = "TANDEM_FAULTS_STATE"  # a directory: each planned call raises once across processes

# Every site, where it sits, and what the code must do when it raises there (docs/reliability.md).
SITES: dict[str, str] = {
    "decode.claim": "decode pod: one source's claim (XREADGROUP) of ready, direct or admission entries",
    "decode.pull": "decode pod: the gRPC KV pull of a claimed ready entry",
    "decode.own": "decode pod: the running-hash write that makes a pulled request or a short prompt its own",
    "decode.ack": "decode pod: the ack of a ready entry once its request is owned",
    "decode.publish": "decode pod: one step's fenced token write (every step of every request)",
    "decode.handback": "decode pod: giving a request it cannot finish back for recovery (resume)",
    "prefill.prefill": "prefill pod: the engine's prefill of one claimed admission entry",
    "prefill.commit": "prefill pod: the fenced commit of a prefill's first token and ready notice",
    "gateway.enqueue": "gateway: one pipeline of admission enqueues (the EnqueueBatcher's enqueue_many)",
    "gateway.read": "gateway: a token reader's blocking XREAD of the token streams it relays",
    "prefill.claim": "prefill pod: one claim round's XREADGROUP of admission entries",
    "decode.step": "decode pod: the engine's generate call of one step (the engine thread)",
    "decode.insert": "decode pod: the engine's insert of a pulled or locally prefilled request into a row (engine thread)",
    "decode.local_prefill": "decode pod: the engine's prefill of a short prompt claimed from the direct stream (engine thread)",
    "recovery.resume": "any resume (a hand-back, a recovery round, a drain): the connection dies with its writes made",
}


class InjectedFault(RuntimeError):
    """Raised by `hit` where the fault plan says so (a test aid)."""


@dataclass(frozen=True)
class _Rule:
    first: int
    last: int | None  # None: every call from `first` on
    kind: str

    def matches(self, n: int) -> bool:
        return n >= self.first and (self.last is None or n <= self.last)


_plan: dict[str, list[_Rule]] | None = None  # None: not read yet
_counts: Counter[str] = Counter()
raised: Counter[str] = Counter()  # faults injected so far, per site


def configure(spec: str | None) -> None:
    """Set the plan (and reset the call counts); "" or None turns every fault off."""
    global _plan
    plan: dict[str, list[_Rule]] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        site, _, rest = part.partition("@")
        calls, _, kind = rest.partition(":")
        kind = kind or "error"
        if site not in SITES or not (kind in ("error", "down") or _sleep_ms(kind) is not None) or not calls:
            raise ValueError(f"bad fault spec {part!r}: want site@N[-M|+][:error|down|sleepMS] with site one of "
                             f"{sorted(SITES)}")
        try:
            if calls.endswith("+"):
                rule = _Rule(int(calls[:-1]), None, kind)
            elif "-" in calls:
                a, b = calls.split("-", 1)
                rule = _Rule(int(a), int(b), kind)
            else:
                rule = _Rule(int(calls), int(calls), kind)
        except ValueError:
            raise ValueError(f"bad fault spec {part!r}: calls must be N, N-M or N+ (1-based)") from None
        plan.setdefault(site, []).append(rule)
    _plan = plan
    _counts.clear()
    raised.clear()
    if plan:
        log.warning("FAULT INJECTION ON (a test aid): %s", spec)


def calls(site: str) -> int:
    """How many times `site` was reached since the plan was set."""
    return _counts[site]


def hit(site: str) -> None:
    """Raise here if the plan says so for this call at `site`."""
    if _plan is None:
        configure(os.environ.get(ENV, ""))
    if not _plan:
        return
    _counts[site] += 1
    n = _counts[site]
    for rule in _plan.get(site, ()):
        ms = _sleep_ms(rule.kind)
        if ms is not None:
            if rule.matches(n):
                time.sleep(ms / 1000)  # blocks the calling thread (at an event loop's site: the whole loop)
            continue
        if rule.matches(n) and _first_time(site, n):
            raised[site] += 1
            log.warning("injected fault at %s (call %d, %s)", site, n, rule.kind)
            if rule.kind == "down":
                raise RedisConnectionError(f"injected fault at {site} (call {n}): Redis looks down")
            raise InjectedFault(f"injected fault at {site} (call {n})")


def _sleep_ms(kind: str) -> int | None:
    """The milliseconds of a `sleepMS` kind, else None."""
    rest = kind.removeprefix("sleep")
    return int(rest) if rest != kind and rest.isdigit() else None


def _first_time(site: str, n: int) -> bool:
    """Whether call `n` at `site` has not raised yet in this cluster (always, without STATE_ENV)."""
    state = os.environ.get(STATE_ENV)
    if not state:
        return True
    try:
        os.close(os.open(os.path.join(state, f"{site}@{n}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
