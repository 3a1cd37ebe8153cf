"""A stock vLLM across nodes: how the nodes' supervisors keep its one group together. Pure.

vLLM's nodes do not follow each other: a head whose `vllm serve` died leaves the
other nodes' workers waiting for ever (vLLM #32136), and a head whose remote
worker died notices only at its next collective, so that the first request
after it fails. Each node's vsup runs its part of the tree (vllm_units.py), and
the parts learn of each other this way:

    A headless node's vsup asks the head's, on the head's --probe-port, every
    head_watch.PERIOD_S and at once when its part goes down:
        GET /group?node=R&gen=G&up=1&t=UNIX&mac=HEX
    (its part's generation, one more at each start, whether it is up, the time,
    and an HMAC of them with the cluster secret), and the head answers
        {"gen": H, "up": true}
    (its own tree's generation, and whether it serves).

- The head restarts its tree when, while it serves, a node says that its part is
  down, or that it is another part than the one that joined this tree (it
  restarted between two reports): the group is broken, and the head would find
  out only when a request failed.
- A node's part has joined once the head serves a tree that it did not serve when
  the part started (vLLM's head cannot serve until every worker of the group is
  in); the part restarts when that tree stops serving or another one serves.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

# how a restart that follows another node's part begins: the group's restart, counted where the death was
FOLLOWS = "the group lost"
MAX_SKEW_S = 60.0  # a report signed longer ago (or ahead) than this is refused: the nodes' clocks agree better


@dataclass(frozen=True)
class Report:
    """What a headless node says of its part."""

    node: int
    gen: int
    up: bool

    def query(self, secret: str, now: float) -> str:
        t = int(now)
        return f"node={self.node}&gen={self.gen}&up={int(self.up)}&t={t}&mac={_mac(secret, self, t)}"


def read_report(query: dict[str, str], secret: str, now: float) -> Report | None:
    """The report of a /group query, or None when it is malformed, signed with another secret, or stale."""
    try:
        report = Report(int(query["node"]), int(query["gen"]), query["up"] == "1")
        t = int(query["t"])
    except (KeyError, ValueError):
        return None
    if abs(now - t) > MAX_SKEW_S or not hmac.compare_digest(_mac(secret, report, t), query.get("mac", "")):
        return None
    return report


def _mac(secret: str, report: Report, t: int) -> str:
    text = f"vsup group {report.node} {report.gen} {int(report.up)} {t}"
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Head:
    """What the head answers: its tree's generation, and whether it serves."""

    gen: int
    up: bool


@dataclass
class Members:
    """The head's side: which part of each node joined its tree of generation `gen`."""

    gen: int = 0
    parts: dict[int, int] = field(default_factory=dict)  # node -> its part's gen

    def heard(self, head: Head, report: Report) -> str | None:
        """Why the head's tree must restart on this report, or None."""
        if head.gen != self.gen:
            self.gen, self.parts = head.gen, {}
        if not head.up:
            return None  # (a tree that does not serve yet waits for its nodes; one going down needs nothing)
        if not report.up:
            return f"{FOLLOWS} node {report.node}'s part (it went down)"
        joined = self.parts.setdefault(report.node, report.gen)
        if joined != report.gen:
            return f"{FOLLOWS} node {report.node}'s part (it started again: its start {report.gen}, not {joined})"
        return None


@dataclass
class Part:
    """A headless node's side: its part's view of the head since the part started."""

    stale: int | None = None  # the head's tree that served when the part started: not the one it joins
    joined: int | None = None

    @classmethod
    def starting(cls, last: Head | None) -> Part:
        return cls(stale=last.gen if last is not None and last.up else None)

    def heard(self, head: Head) -> str | None:
        """`joined` when this answer shows the part in the head's serving tree; why the part must restart
        when the tree it joined is gone; else None."""
        if self.joined is None:
            if head.up and head.gen != self.stale:
                self.joined = head.gen
                return "joined"
            return None
        if not head.up:
            return f"{FOLLOWS} its head (the head's tree {self.joined} stopped serving)"
        if head.gen != self.joined:
            return f"{FOLLOWS} its head (the head serves another tree: {head.gen}, not {self.joined})"
        return None
