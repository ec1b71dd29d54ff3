"""The master measures whether its workers share one medium (``--network auto``).

Two echoes of one worker, the second started half an echo after the first, end at 1.5x one
echo's time on a full-duplex link and at 2x on a half-duplex medium. The testbed's links are
full duplex (a token bucket on each end of a veth pair); redirecting both directions of a pair
through one token bucket on an ifb device makes a half-duplex medium, as one Wi-Fi channel is.
Real worker processes in network namespaces; root, ``ip`` and ``tc`` needed (skipped with the
reason where they are missing). The ratio is timed on a shared machine: once in about 25 runs a
full-duplex link measured 1.77x (over the 1.75x threshold). The master now times a ratio that
close to the cut again (tested below with scripted echo times); the real-link test still gives
a misclassified measurement one more, and two wrong in a row fail.
"""

from __future__ import annotations

import pytest

from hetconv.master import probing
from hetconv.master.client import WorkerClient
from hetconv.master.cluster import ClusterConfig
from hetconv.master.membership import Node
from hetconv.simulations import testbed

UNAVAILABLE = testbed.testbed_unavailable()
needs_testbed = pytest.mark.skipif(
    UNAVAILABLE is not None, reason=f"shaped-link testbed: {UNAVAILABLE}"
)
RATE_MBIT = 40.0


def _connected(address: str, token: str) -> Node:
    node = Node(address, WorkerClient(address, 60.0, token=token))
    probing.connect(node, connect_timeout=60.0, deadline=30.0)
    return node


def test_auto_is_the_default_network_and_compute_reads_no_links():
    assert ClusterConfig().network == "auto"


@pytest.mark.slow  # builds a testbed and times both media (about 14 s)
@needs_testbed
def test_a_full_duplex_link_is_switched_and_a_half_duplex_one_shared():
    with testbed.Testbed(1, RATE_MBIT) as bed:
        (address,) = bed.start_workers()
        node = _connected(address, bed.token)
        try:
            full = probing.measure_medium([node], deadline=30.0)
            print(full.describe())
            if full.shared:  # a noisy moment on this shared machine: one more measurement
                full = probing.measure_medium([node], deadline=30.0)
                print("again:", full.describe())
            assert not full.shared, full.describe()
            assert 1.3 < full.duplex_ratio < HALF, full.describe()
            bed.half_duplex(bed.links[0], RATE_MBIT)
            half = probing.measure_medium([node], deadline=30.0)
            if not half.shared:  # as above
                half = probing.measure_medium([node], deadline=30.0)
            print(half.describe())
            assert half.shared, half.describe()
            assert half.network == "wifi"
            # The medium carries about what one direction of the link did: well under the
            # rate of both directions at once.
            assert half.together_bytes_per_s < 1.3 * RATE_MBIT * 1e6 / 8
        finally:
            node.client.close()
    assert bed.leftovers() == []  # the half-duplex medium went with the testbed


HALF = probing.HALF_DUPLEX_RATIO


class _Scripted:
    """Echo times from a script: single echoes from ``ones`` and overlapping pairs from
    ``pairs``, in order (every worker's echo at once takes 1 s)."""

    def __init__(self, monkeypatch, ones: list[float], pairs: list[float]):
        self.ones, self.pairs = list(ones), list(pairs)
        monkeypatch.setattr(probing, "_echo_seconds", self._single)
        monkeypatch.setattr(probing, "_together", self._together)

    def _single(self, node, payload, deadline):
        return self.ones.pop(0)

    def _together(self, nodes, payloads, deadline, delays):
        if len(nodes) == 2 and nodes[0] is nodes[1]:
            return self.pairs.pop(0)
        return 1.0


class _Fake:
    link_bytes_per_second, link_latency = 5e6, 0.001


@pytest.mark.parametrize(
    ("ones", "pairs", "shared", "echoes", "ratio"),
    [
        ([1.0] * 3, [1.52, 1.55, 1.60], False, 9, 1.52),  # clear: one round
        ([1.0] * 3, [2.00, 1.99, 2.01], True, 9, 1.99),
        # a full-duplex link's pairs all slow once: timed again, the pairs' best decides
        ([1.0] * 6, [1.77, 1.80, 1.79, 1.53, 1.60, 1.56], False, 18, 1.53),
        # a half-duplex medium's single echoes all slow once: the singles' best decides
        ([1.16, 1.15, 1.17, 1.0, 1.01, 1.02], [1.99, 2.00, 1.98, 2.01, 2.0, 1.99], True, 18, 1.98),
        # near the cut after every round: the last ratio decides
        ([1.0] * 9, [1.76] * 9, True, 27, 1.76),
    ],
)
def test_a_ratio_near_the_cut_is_timed_again_with_the_echoes_pooled(
    monkeypatch, ones, pairs, shared, echoes, ratio
):
    script = _Scripted(monkeypatch, ones, pairs)
    medium = probing.measure_medium([_Fake()], deadline=30.0)
    assert medium.shared is shared, medium.describe()
    assert medium.echoes == echoes
    assert medium.duplex_ratio == pytest.approx(ratio)
    assert script.ones == [] and script.pairs == []  # every scripted echo taken, no more
