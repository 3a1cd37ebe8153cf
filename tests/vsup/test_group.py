"""How the nodes' vsups keep a stock vLLM's one group together (vsup/supervisor/group.py): pure, no clock."""

from __future__ import annotations

from urllib.parse import parse_qsl

from vsup.supervisor.group import FOLLOWS, Head, Members, Part, Report, read_report

SECRET = "s3cret"


def query(report: Report, secret=SECRET, t=1000.0) -> dict[str, str]:
    return dict(parse_qsl(report.query(secret, t)))


def test_a_report_is_read_only_signed_with_the_secret_and_fresh():
    report = Report(node=1, gen=3, up=False)
    assert read_report(query(report), SECRET, 1030) == report
    assert read_report(query(report, secret="another"), SECRET, 1000) is None
    assert read_report(query(report), SECRET, 1061) is None and read_report(query(report), SECRET, 939) is None
    forged = {**query(report), "up": "1"}  # (the MAC covers every field)
    assert read_report(forged, SECRET, 1000) is None
    assert read_report({"node": "x"}, SECRET, 1000) is None and read_report({}, SECRET, 1000) is None


def test_the_head_restarts_only_a_serving_tree_whose_node_lost_its_part():
    members = Members()
    assert members.heard(Head(1, False), Report(1, 1, True)) is None  # forming: the head waits
    assert members.heard(Head(1, True), Report(1, 1, True)) is None
    assert members.heard(Head(1, True), Report(1, 1, True)) is None
    assert members.heard(Head(1, True), Report(1, 1, False)) == f"{FOLLOWS} node 1's part (it went down)"
    # a part that restarted between two reports is another part: the group is broken all the same
    assert members.heard(Head(1, True), Report(1, 2, True)).startswith(f"{FOLLOWS} node 1's part (it started again")
    # the head's next tree starts afresh, and a report of a part down while it forms is no reason
    assert members.heard(Head(2, False), Report(1, 2, False)) is None
    assert members.heard(Head(2, True), Report(1, 3, True)) is None
    assert members.parts == {1: 3}


def test_a_part_joins_the_first_tree_the_head_serves_after_it_started_and_follows_it():
    part = Part.starting(None)  # the head was not serving when the part started
    assert part.heard(Head(4, False)) is None
    assert part.heard(Head(4, True)) == "joined" and part.joined == 4
    assert part.heard(Head(4, True)) is None
    assert part.heard(Head(4, False)) == f"{FOLLOWS} its head (the head's tree 4 stopped serving)"
    assert Part(joined=4).heard(Head(5, True)) == f"{FOLLOWS} its head (the head serves another tree: 5, not 4)"
    # the head still served its old tree when the part started: that tree is broken, not the one to join
    stale = Part.starting(Head(4, True))
    assert stale.heard(Head(4, True)) is None
    assert stale.heard(Head(5, True)) == "joined"
