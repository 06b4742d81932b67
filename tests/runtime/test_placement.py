"""Where an elastic job starts new ranks: the hosts a host-discovery script lists, read as
Horovod's elastic mode writes them, and their free slots."""
import socket

import pytest

from vfgraph.runtime.elastic import count_slots, parse_hosts, place

ME = socket.gethostname()


def test_hosts_are_read_in_order_with_their_slots():
    text = "# hosts\nnode1:4\n\nnode2\nlocalhost:2\nnode1:1\n"
    assert parse_hosts(text) == [("node1", 5), ("node2", 1), (ME, 2)]
    assert count_slots(text) == 8


@pytest.mark.parametrize("line", ["node1:x", ":3", "node1:-1"])
def test_a_line_that_is_not_a_host_is_refused(line):
    with pytest.raises(ValueError, match="is not HOST or HOST:SLOTS"):
        parse_hosts(line)


def test_new_ranks_take_the_free_slots_in_the_listed_order():
    hosts = [(ME, 2), ("node2", 2), ("node3", 4)]
    assert place(1, hosts, [ME]) == [(ME, 1)]
    assert place(3, hosts, [ME]) == [(ME, 1), ("node2", 2)]
    assert place(2, hosts, [ME, ME, "node2"]) == [("node2", 1), ("node3", 1)]


def test_ranks_beyond_the_free_slots_go_one_per_host_in_turn():
    assert place(3, [("a", 1), ("b", 1)], ["a"]) == [("b", 2), ("a", 1)]
