"""Which network namespaces a killed run left behind (tools/hosts/network.py's pure part)."""

from kvpush.tools.hosts.network import leftover_tags


def test_only_the_namespaces_of_runs_whose_process_is_gone_are_leftovers():
    names = ["kvp101-sw", "kvp101-h1", "kvp202-sw", "kvp202-p0", "kvpfoo-sw", "kvp303", "other-ns", "kvp404-d0"]
    alive = {202}.__contains__
    assert leftover_tags(names, alive) == {"kvp101", "kvp404"}


def test_no_namespaces_no_leftovers():
    assert leftover_tags([], lambda pid: False) == set()
